"""The cases of the resume tests' shared 4-process job (``resume_jobs`` in conftest.py): test_resume.py's exact
resumes across layouts and test_resume_compressed.py's per-rank optimizer state, one launcher start for both."""

import json
from pathlib import Path

from jobs import dropout_model, ds_config, packed_documents

RESUME_STEPS = 8


def _case(tmp, model, *, stage, micro, accumulation, steps=RESUME_STEPS, **layout) -> dict:
    return dict(
        ds_config=ds_config(stage, micro=micro, accumulation=accumulation),
        model=model,
        steps=steps,
        seq_len=32,
        **layout,
    )


def resume_cases(tmp: Path) -> list[dict]:
    """test_resume.py's cases of the 4-process job (``resume_jobs`` in conftest.py runs them with
    test_resume_compressed.py's: one launcher start for both)."""
    model = dropout_model(tmp)
    series = tmp / "series"
    base = _case(tmp, model, stage=1, micro=2, accumulation=2, tp=2, save=str(series), save_every=2, keep=10)
    cases = [
        base,  # 0: uninterrupted; checkpoints at steps 2, 4, 6, 8
        {**_case(tmp, model, stage=1, micro=2, accumulation=2, tp=2), "load": str(series / "step-0000004")},  # same
        {**_case(tmp, model, stage=0, micro=2, accumulation=2, pp=2), "load": str(series / "step-0000002")},
        {**_case(tmp, model, stage=2, micro=2, accumulation=1), "load": str(series / "step-0000004")},  # DP 4
        {**_case(tmp, model, stage=0, micro=2, accumulation=4, tp=4), "load": str(series / "step-0000006")},
    ]
    # packed documents with loss masks, saved at TP2 x DP2 and resumed at PP2 x DP2 and at DP4 x 2 micro-batches
    documents = dict(data=packed_documents(tmp), reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    config = json.loads(Path(model).read_text()) | {"vocab_size": 300}  # the packed data's tokenizer
    model = tmp / "gpt-tiny-dropout-300.json"
    model.write_text(json.dumps(config))
    model, packed = str(model), tmp / "packed-series"
    cases += [
        {
            **_case(tmp, model, stage=1, micro=2, accumulation=2, tp=2),
            **documents,
            "save": str(packed),
            "save_every": 4,
            "keep": 10,
        },  # 5
        {
            **_case(tmp, model, stage=0, micro=2, accumulation=2, pp=2),
            **documents,
            "load": str(packed / "step-0000004"),
        },  # 6
        {**_case(tmp, model, stage=2, micro=1, accumulation=2), **documents, "load": str(packed / "step-0000004")},
    ]
    rings = tmp / "ring-series"  # context parallelism saved as a ring (CP 2 x DP 2), resumed as Ulysses (a2a)
    base_model = dropout_model(tmp)
    cases += [
        {
            **_case(tmp, base_model, stage=1, micro=2, accumulation=2, cp=2),
            "save": str(rings),
            "save_every": 4,
            "keep": 10,
        },  # 8
        {
            **_case(tmp, base_model, stage=1, micro=2, accumulation=2, cp=2, cp_mode="a2a"),
            "load": str(rings / "step-0000004"),
        },  # 9
    ]
    return cases


COMPRESSED_STEPS, SAVED = 4, 2

METHODS = {  # method -> (ZeRO stage, layout, DP flags)
    "local-sgd": (0, {"tp": 2}, {"local_sgd": 3}),  # DP 2; the save at step 2 averages off the period
    "topk": (0, {"pp": 2}, {"compress": "topk:0.1"}),  # PP2 x DP2
    "int8": (1, {"pp": 2}, {"compress": "int8"}),  # PP2 x DP2, ZeRO-1's buckets compressed
}


def compressed_resume_cases(tmp) -> list[dict]:
    """test_resume_compressed.py's cases of the 4-process job (``resume_jobs`` in conftest.py runs them with
    test_resume.py's)."""
    model = dropout_model(tmp)
    cases = []
    for name, (stage, layout, flags) in METHODS.items():
        base = dict(
            ds_config=ds_config(stage, micro=2, accumulation=2),
            model=model,
            steps=COMPRESSED_STEPS,
            seq_len=32,
            **layout,
            **flags,
        )
        series = tmp / name
        cases.append({**base, "save": str(series), "save_every": SAVED, "keep": 2})
        cases.append({**base, "load": str(series / f"step-{SAVED:07d}")})
    stage, _, flags = METHODS["topk"]  # another layout: DP 4 takes DP rank 0's moments, residuals from zero
    cases.append(
        dict(
            ds_config=ds_config(stage, micro=1, accumulation=2),
            model=model,
            steps=COMPRESSED_STEPS,
            seq_len=32,
            load=str(tmp / "topk" / f"step-{SAVED:07d}"),
            **flags,
        )
    )
    return cases

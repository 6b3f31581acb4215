"""Preference tuning end to end: ``prepare-data`` on TRL's pair shapes, then ``--objective dpo|ipo|simpo`` at every
layout against one process.

The data: 48 rows in TRL's three shapes (standard strings, conversational messages rendered with the chat template,
implicit prompt) and one pair whose chosen equals its rejected (counted and skipped), packed by ``--pack 64`` into
windows of whole pairs. One launcher job of 4 processes trains it at TP 2 with SP, PP 2 x VPP 2, CP 2 as a ring and
as all-to-all, DP with ZeRO 1, 2 and 3, and EP 2 (an MoE model); each case's losses equal the doctor's single-process
``reference_run`` on the same data (fp32, the same tolerance as the token-loss trajectories: the sums differ only in
order), and DPO's first loss is ln 2 at every layout (the policy is the reference). One case saves, and a relaunch
with ``--load auto`` continues on the reference log-probabilities stored beside the run: recomputing them from the
trained weights would move its losses off the uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from chat import CHATML, _tokenizer
from jobs import ds_config, sweep
from paths import ROOT

from megakit.commands import cli

WINDOW = 64
STEPS = 2  # the first (ln 2 for DPO) and one after an update
TOL = 2e-5  # fp32 loss: the distributed sums differ from the single process's by order only (test_trainer.LOSS_TOL)


def _rows(n: int = 48) -> list[dict]:
    rng = random.Random(0)
    words = "what is the weather in Paris it sunny thanks for asking".split()

    def say(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    rows = []
    for i in range(n):
        user = [{"role": "user", "content": say(2)}]
        if i % 3 == 0:  # standard
            rows.append({"prompt": say(1 + i % 4), "chosen": " " + say(2 + i % 5), "rejected": " " + say(1 + i % 3)})
        elif i % 3 == 1:  # conversational
            rows.append(
                {
                    "prompt": user,
                    "chosen": [{"role": "assistant", "content": say(3)}],
                    "rejected": [{"role": "assistant", "content": say(1 + i % 4)}],
                }
            )
        else:  # implicit prompt
            rows.append(
                {
                    "chosen": user + [{"role": "assistant", "content": say(2)}],
                    "rejected": user + [{"role": "assistant", "content": say(4)}],
                }
            )
    return rows + [{"prompt": "same", "chosen": " x", "rejected": " x"}]


def _prepare(tmp: Path, rows: list[dict], out: str, *flags: str) -> int:
    (tmp / f"{out}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cli.main(
        ["prepare-data", str(tmp / f"{out}.jsonl"), "--tokenizer", str(tmp / "tok"), "--out", str(tmp / out)]
        + ["--val-fraction", "0", "--no-progress", *flags]
    )


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    _tokenizer(tmp / "tok", CHATML)
    assert _prepare(tmp, _rows(), "packed", "--pack", str(WINDOW)) == 0
    return tmp


def test_pairs_are_whole_windows_of_two_documents_with_the_completion_counted(pairs, capsys):
    from megakit.train.data.corpus import open_corpus

    corpus = open_corpus(str(pairs / "packed"))
    index = json.loads((pairs / "packed" / "index.json").read_text())
    assert index["summary"]["preference"] == {"pairs": 48, "identical": 1, "truncated": 0}
    assert corpus.packed == WINDOW and corpus.pairs % 2 == 0
    tokens, mask, starts = corpus.train[0], corpus.train_masks[0], np.asarray(corpus.train_documents[0])
    assert len(tokens) % WINDOW == 1 and set(starts % WINDOW) >= {0}  # each window starts a document
    ends = np.append(starts[1:], len(tokens) - 1)
    sequences = [(a, b) for a, b in zip(starts, ends) if mask[a:b].any()]
    assert len(sequences) == 96  # two per pair; padding runs count nothing
    for a, b in sequences:
        assert a // WINDOW == (b - 1) // WINDOW  # never across a window
        counted = np.flatnonzero(mask[a:b])
        assert counted[0] > 0 and np.all(np.diff(counted) == 1) and counted[-1] == b - a - 1  # the completion, last
    pairs_by_window = {}
    for a, _ in sequences:
        pairs_by_window[a // WINDOW] = pairs_by_window.get(a // WINDOW, 0) + 1
    assert all(n % 2 == 0 for n in pairs_by_window.values())  # whole pairs in each window


@pytest.mark.parametrize(
    "rows, flags, words",
    [
        ([{"prompt": "a", "chosen": " b"}], [], "'rejected'"),
        ([{"prompt": "word " * 40, "chosen": " b", "rejected": " c"}], [], "prompt has"),
        ([{"prompt": "a", "chosen": " b" * 80, "rejected": " c"}], ["--too-long", "refuse"], "does not fit"),
        ([{"prompt": "a", "chosen": " b", "rejected": " b"}], [], "no preference pair"),
    ],
    ids=["missing", "prompt-too-long", "refused", "all-identical"],
)
def test_bad_pairs_are_one_line_exit_2_and_nothing_written(pairs, capsys, rows, flags, words):
    name = f"bad-{abs(hash(words))}"
    assert _prepare(pairs, rows, name, "--pack", str(WINDOW), *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (pairs / name).exists() and not list(pairs.glob(f".{name}*"))


def test_bad_train_flags_are_one_line(pairs, tmp_path):
    from megakit.errors import UsageError
    from megakit.train.run import TrainConfig, resolve

    with pytest.raises(UsageError, match="--simpo-gamma"):
        TrainConfig(ds_config=ds_config(1), objective="dpo", simpo_gamma=0.3)
    (tmp_path / "t.txt").write_text("plain text, no pairs " * 400)
    with pytest.raises(UsageError, match="holds none"):  # DPO on data without pairs
        resolve(
            TrainConfig(
                ds_config=ds_config(1), model="llama-tiny", seq_len=64, data=str(tmp_path / "t.txt"), objective="dpo"
            ),
            1,
            say=lambda *_: None,
        )


def _model(tmp: Path, name: str) -> str:
    config = json.loads((ROOT / "models" / f"{name}.json").read_text()) | {"vocab_size": 302}  # the tokenizer's
    path = tmp / f"{name}-302.json"
    path.write_text(json.dumps(config))
    return str(path)


DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True)


def test_every_layout_equals_one_process(pairs, tmp_path_factory):
    from megakit.train.doctor.reference import reference_run

    llama, moe, data = _model(pairs, "llama-tiny"), _model(pairs, "moe-tiny"), str(pairs / "packed")

    def case(stage, model=llama, *, micro=2, accumulation=1, objective="dpo", **layout):
        config = ds_config(stage, micro=micro, accumulation=accumulation)
        return dict(
            ds_config=config,
            model=model,
            steps=STEPS,
            seq_len=WINDOW,
            data=data,
            objective=objective,
            **DOCUMENTS,
            **layout,
        )

    saved = str(pairs / "saved")
    cases = {  # each layout once, the objectives spread over them
        "tp-sp-saves": {**case(1, tp=2, sequence_parallel=True, accumulation=2), "steps": 1, "save": saved},
        "tp-sp-resumes": {**case(1, tp=2, sequence_parallel=True, accumulation=2), "save": saved, "load": "auto"},
        "pp-vpp-tp": case(0, pp=2, vpp=2, tp=2, micro=2, accumulation=4, schedule="interleaved"),
        "cp-ring-zero3-simpo": case(
            3, cp=2, accumulation=2, cp_mode="ring", objective="simpo", simpo_gamma=0.3, label_smoothing=0.1
        ),
        "cp-a2a-tp-zero2-ipo": case(2, cp=2, tp=2, micro=4, accumulation=2, cp_mode="a2a", objective="ipo"),
        "ep": case(1, moe, ep=2, accumulation=2),
    }
    results = dict(zip(cases, sweep(tmp_path_factory, 4, list(cases.values()), timeout=900)))
    references = {}
    for name, c in cases.items():
        dp = 4 // (c.get("tp", 1) * c.get("pp", 1) * c.get("cp", 1))
        flags = {k: c[k] for k in ("objective", "simpo_gamma", "label_smoothing") if k in c}
        key = (c["model"], json.dumps(c["ds_config"], sort_keys=True), dp, json.dumps(flags, sort_keys=True))
        if key not in references:
            references[key] = reference_run(
                c["ds_config"],
                model=c["model"],
                steps=4,
                dp=dp,
                seq_len=WINDOW,
                data=data,
                documents=DOCUMENTS,
                preference=flags,
            )
            references[key] = references[key]["loss"], references[key]["grad_norm"]
        want, norms = references[key]
        got = results[name]["loss"]
        for step, norm in enumerate(results[name]["grad_norm"], start=1 if name.endswith("resumes") else 0):
            assert abs(norm - norms[step]) < 2e-3 * norms[step], (name, step, norm, norms[step])  # Adam hides a scale
        first = 1 if name.endswith("resumes") else 0
        assert len(got) == c["steps"] - first, (name, got)
        for step, loss in enumerate(got, start=first):
            assert abs(loss - want[step]) < TOL, (name, step, loss, want[step])
        if c["objective"] == "dpo" and first == 0:
            assert abs(got[0] - math.log(2)) < 1e-6, (name, got[0])
    assert Path(saved + ".reference-logps.npz").is_file()


def test_implicit_prompts_and_truncation_by_hand():
    from megakit.interop.preference_data import pair_sequences, split_pair

    user = [{"role": "user", "content": "hi"}]
    say = {"role": "assistant", "content": "a"}
    row = {"chosen": user + [say], "rejected": user + [{**say, "content": "b"}]}
    assert split_pair(row, "row") == (user, [say], [{**say, "content": "b"}])
    assert split_pair({"chosen": "Q: x A: yes", "rejected": "Q: x A: no"}, "row") == ("Q: x A: ", "yes", "no")
    (chosen, rejected), cut = pair_sequences([1, 2], [[3] * 20, [4] * 5], 20, "truncate", "row")
    assert cut and len(chosen[0]) + len(rejected[0]) == 20 and len(rejected[0]) == 7  # the short one kept whole
    assert chosen[1].tolist() == [0, 0] + [1] * 11 and rejected[1].sum() == 5


def test_the_stored_reference_names_the_lora_base_it_is_of():
    """A fresh LoRA run loads no checkpoint (``run.checkpoint`` None): the stamp must still tell two bases apart, or
    a second run on one ``--save`` would reuse the first base's reference log-probabilities."""
    from types import SimpleNamespace

    from megakit.train.observe.preference import reference_stamp

    def run(base):
        cfg = SimpleNamespace(model="llama-tiny", seed=0)
        corpus, batch = SimpleNamespace(fingerprint="f"), SimpleNamespace(seq_len=64)
        return SimpleNamespace(cfg=cfg, corpus=corpus, batch=batch, checkpoint=None, lora_base=base)

    stamps = [reference_stamp(run(base), windows=8, slots=2)[1] for base in (None, "base-a", "base-b")]
    assert stamps[1] != stamps[2] and stamps[0] != stamps[1]
    assert "lora_base" not in stamps[0]["start"]  # a full fine-tune's stamp is as it was: stored files stay valid

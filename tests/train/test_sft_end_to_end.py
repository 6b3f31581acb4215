"""Fine-tuning a transformers chat model on chat data, end to end, from local files only.

A tiny Llama chat model as released ones are shaped is written by the test as a transformers directory: a byte-level
BPE tokenizer with a ChatML template without {% generation %} markers, eos ``<|im_end|>``, pad ``<|endoftext|>``, no
bos, and a ``generation_config.json`` with two stop ids. ``convert --from-hf`` makes it a megakit checkpoint;
``prepare-data`` renders a chat JSONL with that tokenizer and writes the assistant-only loss mask (found from the
template's prefixes); the trainer fine-tunes it at TP 2 x PP 2 through the launcher; ``convert --to-hf`` exports it,
and transformers loads the result, renders a prompt with the template that travelled with the data, and generates
until the end of the turn, as ``megakit generate --chat`` does. Each of the 20 steps' losses equals transformers'
``Trainer`` on the same examples in the same order (token-averaged, ``average_tokens_across_devices``) within fp32
rounding: same AdamW (Adam's eps 1e-4: no near-ties, see ``test_trainer.sync_cases``), clipping, constant LR, and
transformers' own decay rule.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from chat import CHATML_RELEASED, _conversations, _unmarked, released_chat_model
from multiproc import THREADS, free_port
from paths import ROOT
from tolerance import fp32_bound

transformers = pytest.importorskip("transformers")

from megakit.commands.cli import main  # noqa: E402
from megakit.train.observe.metrics import read_metrics  # noqa: E402

STEPS = 20


def _trainer_losses(hf, data: str, tmp_path) -> list[float]:
    """transformers' ``Trainer`` on megakit's batches, in megakit's order: each window as 33 ids (HF shifts the labels
    itself), its labels the masked targets; 2 per micro-batch, 2 micro-batches a step, sequential."""
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus

    corpus = open_corpus(data)
    plan = BatchPlan(seq_len=32, micro_batch=4)
    masked, raw = TokenBatches(corpus.train, plan, corpus.train_masks), TokenBatches(corpus.train, plan)
    rows = []
    for step in range(STEPS):
        (x, y), (_, targets) = masked.global_batch(step), raw.global_batch(step)
        for r in range(len(x)):
            rows.append(
                {"input_ids": torch.cat([x[r], targets[r, -1:]]), "labels": torch.cat([torch.tensor([-100]), y[r]])}
            )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_epsilon=1e-4,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        train_sampling_strategy="sequential",
        average_tokens_across_devices=True,
        disable_tqdm=True,
        seed=0,
    )
    logged = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    model = transformers.AutoModelForCausalLM.from_pretrained(hf).float()
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Losses()]).train()
    return logged


def _says_then_stops(model, tokenizer) -> list[int]:
    """Make the model's greedy reply, by construction, the first token of "sunny" then ``<|im_end|>``: after the
    generation prompt's newline it says that token, after that token ``<|im_end|>``, and after ``<|im_end|>`` a
    newline again (as a chat model runs on into invented turns). Each of the three inputs gets its own axis of the
    embedding and the matching head row reads only that axis, so the three logits lead by ~11 whatever the
    fine-tune's 20 small steps do. Returns the reply's ids."""
    newline, end = tokenizer.encode("\n", add_special_tokens=False)[0], tokenizer.convert_tokens_to_ids("<|im_end|>")
    word = tokenizer.encode("sunny", add_special_tokens=False)[0]
    with torch.no_grad():
        for axis, (now, then) in enumerate(((newline, word), (word, end), (end, newline))):
            model.model.embed_tokens.weight[now] = 0
            model.model.embed_tokens.weight[now, axis] = 1
            model.lm_head.weight[then] = 0
            model.lm_head.weight[then, axis] = 2
    return [word, end]


@pytest.mark.slow
def test_a_chat_fine_tune_from_transformers_and_back(tmp_path, capsys):
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus

    chatml = _unmarked(CHATML_RELEASED)  # as released: no {% generation %} markers
    hf = tmp_path / "hf"
    model, hf_tokenizer = released_chat_model(hf, max_positions=64)
    end, pad = hf_tokenizer.convert_tokens_to_ids("<|im_end|>"), hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    reply = _says_then_stops(model, hf_tokenizer)
    model.save_pretrained(hf, safe_serialization=True)
    assert main(["convert", str(hf), str(tmp_path / "ck"), "--from-hf"]) == 0
    capsys.readouterr()  # the import carries the tokenizer: it chats, and stops, before any training
    assert main(["generate", str(tmp_path / "ck"), "--chat", "--prompt", "hi", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == hf_tokenizer.decode(reply[:1]) + "\n"
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(160)))
    assert (
        main(
            [
                "prepare-data",
                str(tmp_path / "chats.jsonl"),
                "--tokenizer",
                str(hf),
                "--loss-on",
                "assistant",
                "--out",
                str(tmp_path / "data"),
                "--val-fraction",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = subprocess.run(
        [
            "deepspeed",
            "--num_gpus",
            "4",
            "--master_port",
            str(free_port()),
            "scripts/train.py",
            "--ds_config",
            str(tmp_path / "ds.json"),
            "--model",
            str(hf),
            "--load",
            str(tmp_path / "ck"),
            "--data",
            str(tmp_path / "data"),
            "--steps",
            str(STEPS),
            "--tp",
            "2",
            "--pp",
            "2",
            "--seq-len",
            "32",
            "--save",
            str(tmp_path / "trained"),
            "--metrics-out",
            str(tmp_path / "m.json"),
            "--no-progress",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [step["loss"] for step in read_metrics(tmp_path / "m.json")["steps"]]

    corpus = open_corpus(str(tmp_path / "data"))  # the first step's batch, as one process reads it
    x, y = TokenBatches(corpus.train, BatchPlan(seq_len=32, micro_batch=4), corpus.train_masks).global_batch(0)
    assert 0 < int((y != -100).sum()) < y.numel()  # the assistant's tokens only
    with torch.no_grad():
        logits = model.float()(x).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert abs(losses[0] - want) <= fp32_bound(want, int((y != -100).sum())), (losses[0], want)
    reference = _trainer_losses(hf, str(tmp_path / "data"), tmp_path)
    assert len(reference) == len(losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= 1e-5, (step, a, b)

    exported = tmp_path / "exported"
    assert main(["convert", str(tmp_path / "trained"), "--to-hf", str(exported)]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported), local_files_only=True)
    # the tokenizer and the model's stop ids travelled: data, checkpoint, export
    assert tokenizer.chat_template == chatml
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tokenizer.added_tokens_decoder == hf_tokenizer.added_tokens_decoder
    assert json.loads((exported / "generation_config.json").read_text()) == json.loads(
        (hf / "generation_config.json").read_text()
    )
    assert tuned.config.eos_token_id == [end, pad] and tuned.config.bos_token_id is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is the weather?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = tuned.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert generated[0, prompt["input_ids"].shape[1] :].tolist() == reply  # it stops at the end of its turn
    capsys.readouterr()
    assert (
        main(["generate", str(exported), "--chat", "--prompt", "what is the weather?", "--max-new-tokens", "12"]) == 0
    )
    assert capsys.readouterr().out == tokenizer.decode(reply[:1]) + "\n"
    (tmp_path / "chat.json").write_text(
        json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the weather?"}])
    )
    assert main(["generate", str(exported), "--messages", str(tmp_path / "chat.json"), "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(reply[:1]) + "\n"
    moved = max((a - b).abs().max().item() for a, b in zip(tuned.parameters(), model.parameters()))
    assert moved > 1e-4  # the fine-tune changed the weights it exported

"""Fine-tuning a transformers model on chat data, end to end, from local files only.

A tiny Llama and a ChatML tokenizer (with generation markers) are written by the test as a transformers directory;
``convert --from-hf`` makes it a megakit checkpoint; ``prepare-data`` renders a chat JSONL with that tokenizer and
writes the assistant-only loss mask; the trainer fine-tunes it at TP 2 x PP 2 through the launcher; ``convert
--to-hf`` exports it, and transformers loads the result, renders a prompt with the template that travelled with the
data, and generates. Each of the 20 steps' losses equals transformers' ``Trainer`` on the same examples in the same
order (token-averaged, ``average_tokens_across_devices``) within fp32 rounding: same AdamW (Adam's eps 1e-4: no
near-ties, see ``test_trainer.sync_cases``), clipping, constant LR, and transformers' own decay rule.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from multiproc import THREADS, free_port
from test_chat_data import CHATML, _conversations, _tokenizer
from test_trainer import ROOT
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
            rows.append({"input_ids": torch.cat([x[r], targets[r, -1:]]),
                         "labels": torch.cat([torch.tensor([-100]), y[r]])})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
        adam_epsilon=1e-4, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", train_sampling_strategy="sequential", average_tokens_across_devices=True,
        disable_tqdm=True, seed=0)
    logged = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    model = transformers.AutoModelForCausalLM.from_pretrained(hf).float()
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Losses()]).train()
    return logged


@pytest.mark.slow
def test_a_chat_fine_tune_from_transformers_and_back(tmp_path):
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus

    hf = _tokenizer(tmp_path / "hf", CHATML)  # the tokenizer first, then the model beside it
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(hf), local_files_only=True))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(hf, safe_serialization=True)
    assert main(["convert", str(hf), str(tmp_path / "ck"), "--from-hf"]) == 0
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(160)))
    assert main(["prepare-data", str(tmp_path / "chats.jsonl"), "--tokenizer", str(hf), "--loss-on", "assistant",
                 "--out", str(tmp_path / "data"), "--val-fraction", "0", "--no-progress"]) == 0
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = subprocess.run(["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "scripts/train.py",
                          "--ds_config", str(tmp_path / "ds.json"), "--model", str(hf), "--load", str(tmp_path / "ck"),
                          "--data", str(tmp_path / "data"), "--steps", str(STEPS), "--tp", "2", "--pp", "2", "--seq-len", "32",
                          "--save", str(tmp_path / "trained"), "--metrics-out", str(tmp_path / "m.json"),
                          "--no-progress"],
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=THREADS), capture_output=True, text=True,
                         timeout=300)
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

    assert main(["convert", str(tmp_path / "trained"), "--to-hf", str(tmp_path / "exported")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert tokenizer.chat_template == CHATML  # the template travelled: data, checkpoint, export
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is the weather?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = tuned.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5
    moved = max((a - b).abs().max().item() for a, b in zip(tuned.parameters(), model.parameters()))
    assert moved > 1e-4  # the fine-tune changed the weights it exported

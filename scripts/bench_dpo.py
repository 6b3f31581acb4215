"""megakit's DPO step against TRL's DPOTrainer: the same tiny Llama, the same tokenized pairs, one process.

    python scripts/bench_dpo.py [--steps 12] [--batch 8] [--pairs 96] [--hidden 64] [--layers 4]

Both start from one set of weights (megakit's Transformer, exported to transformers' LlamaForCausalLM) and train the
pairs TRL tokenized (its ``prompt_ids``/``chosen_ids``/``rejected_ids``) with AdamW at the same learning rate, beta
0.1, and the reference log-probabilities computed once before training (TRL's ``precompute_ref_log_probs=True``;
without it TRL runs the reference model every step as well). A step is the forward, the backward and the optimizer
step on ``--batch`` pairs: TRL's ``training_step`` padded to the batch's longest sequence as its collator pads,
megakit's pairs packed into windows of whole pairs (``prepare-data --pack``), each sequence its own document (`--pad`:
one pair a window, as padded as TRL's batches). The first step's losses are printed (ln 2 for both: the policy is the
reference), then the median step time of each and the ratio. On CPU it runs on one thread (OMP_NUM_THREADS) unless
told.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.interop.hf import hf_config, to_hf_state_dict  # noqa: E402
from megakit.interop.preference_data import pair_bins, pair_sequences  # noqa: E402
from megakit.nn.attention.masks import position_ids  # noqa: E402
from megakit.nn.model import Transformer, full_state_dict, set_loss_tokens, set_preference  # noqa: E402
from megakit.nn.tensor_parallel.preference import Preference, count_pairs  # noqa: E402

WORDS = "what is the weather in Paris it sunny thanks for asking a question about the sea and the sky".split()


def tokenizer(directory: Path):
    """A byte-level BPE over the words, as transformers saves one (eos and pad ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [" ".join(WORDS)] * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    return fast


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [
        {
            "prompt": say(rng.randint(4, 12)),
            "chosen": " " + say(rng.randint(8, 24)),
            "rejected": " " + say(rng.randint(8, 24)),
        }
        for _ in range(n)
    ]


def models(args, vocab: int):
    """megakit's Transformer and transformers' Llama with the same weights (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }
    config = ModelConfig.from_hf(spec)
    ours = Transformer(config, seed=args.seed)
    theirs = LlamaForCausalLM(LlamaConfig(**{**hf_config(config), "attn_implementation": "sdpa"}))
    missing, unexpected = theirs.load_state_dict(to_hf_state_dict(config, full_state_dict(ours)), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return ours, theirs.float()


def trl_steps(args, model, tok, data, out: Path) -> tuple[list[float], float, object]:
    """TRL's per-step seconds (its training_step and optimizer step), its first loss, and its tokenized data set."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    seconds, losses = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            seconds.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = DPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=0.1,
        precompute_ref_log_probs=True,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        max_length=None,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(data), processing_class=tok)
    trainer.add_callback(Clock())
    trainer.train()
    return seconds, losses[0], trainer.train_dataset


def megakit_steps(args, model, dataset, eos: int, device) -> tuple[list[float], float]:
    """megakit's per-step seconds and first loss: the same pairs, packed into windows of whole pairs."""
    pairs = [
        pair_sequences(list(r["prompt_ids"]), [list(r["chosen_ids"]), list(r["rejected_ids"])], 10**6, "refuse", "")[0]
        for r in dataset
    ]
    longest = max(len(a[0]) + len(b[0]) for a, b in pairs)
    window = longest if args.pad else 2 * longest  # --pad: one pair a window; else room for two or more
    window += -window % 8
    model.to(device)
    pref = Preference(objective="dpo", beta=0.1)
    set_preference(model, pref)

    def batch(k: int):
        chosen = [pairs[(k * args.batch + i) % len(pairs)] for i in range(args.batch)]
        bins = list(pair_bins(chosen, window, pack=not args.pad, pad_id=eos))
        ids = torch.stack([torch.from_numpy(b[0]) for b in bins])
        mask = torch.stack([torch.from_numpy(b[1]) for b in bins])
        docs = torch.stack(
            [
                torch.from_numpy((torch.arange(window)[:, None] >= torch.tensor(b[2])[None]).sum(1).numpy() - 1)
                for b in bins
            ]
        )
        x, y = ids[:, :-1], ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        d = docs[:, :-1]
        return x.to(device), y.to(device), d.to(device), position_ids(d).to(device)

    batches = [batch(k) for k in range(args.steps)]
    slots = 2 * args.batch + 2
    references = []
    model.eval()
    with torch.no_grad():  # the reference pass, once
        for x, y, d, p in batches:
            model(x, y, documents=d, position_ids=p, reference=torch.zeros(x.shape[0], slots, device=device))
            references.append(model.sequence_logps.clone())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seconds, first = [], None
    for (x, y, d, p), ref in zip(batches, references):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        set_loss_tokens(model, count_pairs(y, d, slots).clamp(min=1).float())
        loss = model(x, y, documents=d, position_ids=p, reference=ref)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        first = float(loss.detach()) if first is None else first
    return seconds, first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="pairs per step")
    p.add_argument("--pairs", type=int, default=96)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad", action="store_true", help="megakit: one pair a window (padded), not packed")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tok = tokenizer(out / "tok")
        ours, theirs = models(args, len(tok))
        trl_seconds, trl_first, dataset = trl_steps(args, theirs, tok, rows(args.pairs, args.seed), out)
        mk_seconds, mk_first = megakit_steps(args, ours, dataset, tok.eos_token_id, device)
    skip = min(2, args.steps - 1)  # warm-up steps left out of the medians
    trl_median, mk_median = statistics.median(trl_seconds[skip:]), statistics.median(mk_seconds[skip:])
    print(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, threads {torch.get_num_threads()}"
    )
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers; {args.batch} pairs a step, {args.steps} steps")
    print(f"first-step DPO loss: TRL {trl_first:.4f}, megakit {mk_first:.4f} (ln 2 = {math.log(2):.4f})")
    print(f"TRL DPOTrainer step: {trl_median * 1e3:8.1f} ms (median of steps {skip}..{args.steps - 1})")
    print(f"megakit DPO step:    {mk_median * 1e3:8.1f} ms ({'one pair a window' if args.pad else 'pairs packed'})")
    faster = "megakit faster" if mk_median < trl_median else "TRL faster"
    print(f"ratio TRL / megakit: {trl_median / mk_median:.2f}x ({faster})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

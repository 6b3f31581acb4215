"""LoRA's step against a full fine-tune's, and against peft on transformers, side by side (issue 46).

    python scripts/bench_lora.py                      # a small Llama (hidden 512, 4 layers), batch 4 x 256
    python scripts/bench_lora.py --hidden 1024 --layers 8 --steps 10 --json out.json

One process, three runs on the same model shape, batch, rank and targets (all-linear, rank 16 by default):

- ``megakit full``: megakit's model (``megakit.nn.model.Transformer``), every weight trained;
- ``megakit LoRA``: the same model, base frozen, adapters attached by ``megakit.nn.lora.add_lora``;
- ``peft LoRA``: transformers' ``LlamaForCausalLM`` of the same shape under ``peft.get_peft_model``.

Each: forward, backward and AdamW's step on the trained parameters (torch's optimizer, not DeepSpeed's engine: this
measures the model and its adapters, not the engine around them), ``--warmup`` steps, then the median of
``--steps`` (wall time on a GPU; on a CPU the process's CPU time, which other jobs on a shared host do not
inflate). Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU what the step holds at its peak,
counted: parameters, gradients, Adam's states and the tensors autograd saved (by storage, each once). Targets: LoRA
at most 0.75x the full fine-tune's step, and at least as fast as peft's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megakit.core.lora import LoraSpec
from megakit.core.model_config import ModelConfig
from megakit.core.planner.model_spec import ModelSpec
from megakit.nn.lora import add_lora, linear_names
from megakit.nn.model import Transformer


class SavedBytes:
    """Bytes autograd saves during a forward, each storage once (``saved_tensors_hooks``)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer states, in bytes."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return params + grads + states


def _run(model, loss_of, batch, *, steps: int, warmup: int, device) -> dict:
    """Median seconds of forward + backward + AdamW step, and the peak bytes (see the module docstring)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    clock = time.perf_counter if device.type == "cuda" else time.process_time  # CPU time: the host is shared
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    times, peak = [], 0
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        saved = SavedBytes()
        start = clock()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = loss_of(model, *batch)
        loss.backward()
        held = _held(model, optimizer) + saved.total  # gradients and the saved tensors, before the step frees any
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(clock() - start)
            peak = max(peak, torch.cuda.max_memory_allocated() if device.type == "cuda" else held)
    return {"step_s": statistics.median(times), "peak_bytes": peak, "trained": sum(p.numel() for p in trained)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all-linear", help="comma-separated module names, or all-linear (default)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    import peft
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = ModelConfig.load("llama-tiny").replace(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.heads // 2,
        head_dim=args.hidden // args.heads,
        ffn=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
    )
    targets = tuple(t for t in args.targets.split(",") if t)
    spec = LoraSpec(rank=args.rank, alpha=2.0 * args.rank, targets=targets)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    run = dict(steps=args.steps, warmup=args.warmup, device=device)

    def megakit_loss(model, x, y):
        return model(x, y)

    def hf_loss(model, x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    results = {}
    full = Transformer(config, seed=args.seed, dtype=dtype, device=device)
    results["megakit full"] = _run(full, megakit_loss, (ids, labels), **run)
    del full
    lora = Transformer(config, seed=args.seed, dtype=dtype, device=device)
    add_lora(lora, spec, config=config, seed=args.seed)
    results["megakit LoRA"] = _run(lora, megakit_loss, (ids, labels), **run)
    del lora
    hf_config = transformers.LlamaConfig(**ModelSpec.from_model_config(config, name="bench").to_hf_config())
    hf = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=dtype)
    modules = list(spec.resolve(linear_names(config))) if targets != ("all-linear",) else "all-linear"
    peft_config = peft.LoraConfig(r=args.rank, lora_alpha=2.0 * args.rank, lora_dropout=0.0, target_modules=modules)
    results["peft LoRA"] = _run(peft.get_peft_model(hf, peft_config), hf_loss, (ids, labels), **run)

    base = results["megakit full"]
    print(
        f"LoRA bench on {device.type} ({dtype}, {torch.get_num_threads()} thread(s)): hidden {args.hidden}, "
        f"{args.layers} layers, FFN {args.ffn}, vocab {args.vocab}, batch {args.batch} x {args.seq_len}, rank "
        f"{args.rank} on {args.targets}; median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'run':<14} {'trained':>12} {'step ms':>9} {'vs full':>8} {'peak MiB':>9} {'vs full':>8}")
    for name, r in results.items():
        print(
            f"{name:<14} {r['trained']:>12,} {r['step_s'] * 1e3:>9.1f} {r['step_s'] / base['step_s']:>7.2f}x "
            f"{r['peak_bytes'] / 2**20:>9.1f} {r['peak_bytes'] / base['peak_bytes']:>7.2f}x"
        )
    ratio = results["megakit LoRA"]["step_s"] / base["step_s"]
    vs_peft = results["peft LoRA"]["step_s"] / results["megakit LoRA"]["step_s"]
    met = {True: "met", False: "missed"}
    print(
        f"targets: LoRA step {ratio:.2f}x the full fine-tune's (target <= 0.75x: {met[ratio <= 0.75]}); "
        f"megakit LoRA {vs_peft:.2f}x peft's speed (target >= 1.00x: {met[vs_peft >= 1]})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device.type, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

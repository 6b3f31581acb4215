"""Benchmark: one MoE layer (router, dispatch, experts, shared expert, balancing losses), forward + backward, eager
against ``torch.compile``, per model family, in one process.

Three forms of the same layer with the same weights and tokens: ``loop`` (the experts one at a time, their row
counts copied to the host: megakit's path before issue 54), ``grouped`` (``torch._grouped_mm`` over device offsets,
no host sync: today's eager path) and ``compiled`` (that layer through ``torch.compile``, Inductor by default). Per
form: the median forward + backward milliseconds over the timed rounds (CPU time on the CPU); for the compiled one
also the first call's wall seconds (compiling), Dynamo's graph and break counts and the largest output gap to the
grouped form. Families: the routing and expert options of ``moe-tiny`` (softmax, shared expert with its gate),
``deepseek-v3-tiny`` (sigmoid, expert groups, the expert bias) and ``gpt-oss-tiny`` (router bias, expert biases,
clamped SwiGLU), at the widths given here.

    python scripts/bench_moe_block.py                    # CPU, fp32, hidden 256, ffn 512, 8 experts, 2048 tokens
    python scripts/bench_moe_block.py --backend aot_eager --tokens 256

``moe_block_rows`` is what ``scripts/bench_gpu.py`` calls for its MoE rows (bf16 on the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

FAMILIES = ("moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny")


def _layer(family: str, *, hidden: int, ffn: int, experts: int, top_k: int, dtype, device, grouped, moe=None):
    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.nn.moe.layer import MoE

    overrides, moe = moe, ModelConfig.load(family).moe
    groups = min(moe.groups, experts)
    config = dataclasses.replace(
        moe,
        experts=experts,
        top_k=top_k,
        ffn=ffn,
        shared_ffn=ffn if moe.shared_ffn else 0,
        groups=groups,
        group_top_k=min(moe.group_top_k, groups),
        **(overrides or {}),
    )
    torch.manual_seed(0)
    layer = MoE(config, hidden, dtype=dtype, device=device, grouped=grouped)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer


def _sync(device) -> None:
    import torch

    if torch_device_type(device) == "cuda":
        torch.cuda.synchronize()


def _timed(step, device, repeat: int) -> float:
    """Median milliseconds of ``step()`` over ``repeat`` rounds: on CUDA wall time, the device synchronised around
    each; on the CPU this process's CPU time (one thread: what the step costs, whatever else loads the machine)."""
    clock = time.perf_counter if torch_device_type(device) == "cuda" else time.process_time
    times = []
    for _ in range(repeat):
        _sync(device)
        start = clock()
        step()
        _sync(device)
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def torch_device_type(device) -> str:
    import torch

    return torch.device(device).type


def moe_block_rows(
    *,
    families=FAMILIES,
    hidden: int = 256,
    ffn: int = 512,
    experts: int = 8,
    top_k: int = 2,
    tokens: int = 2048,
    dtype=None,
    device: str = "cpu",
    backend: str = "inductor",
    repeat: int = 10,
    moe: dict | None = None,
) -> list[dict]:
    """One row per family: loop, grouped and compiled forward + backward ms, compile seconds, graphs, breaks.
    ``moe``: ``MoEConfig`` fields to change in every family (a capacity factor)."""
    import torch
    import torch._dynamo

    dtype = dtype or torch.float32
    x = torch.randn(tokens // 2, 2, hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    rows = []
    for family in families:
        row = dict(
            family=family,
            hidden=hidden,
            ffn=ffn,
            experts=experts,
            top_k=top_k,
            tokens=tokens,
            dtype=str(dtype).removeprefix("torch."),
            device=device,
            backend=backend,
        )
        outputs = {}
        for form, grouped in (("loop", False), ("grouped", True), ("compiled", True)):
            layer = _layer(
                family,
                hidden=hidden,
                ffn=ffn,
                experts=experts,
                top_k=top_k,
                dtype=dtype,
                device=device,
                grouped=grouped,
                moe=moe,
            )
            if form == "compiled":
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                layer.compile(backend=backend, dynamic=False)
            inputs = x.clone().requires_grad_()

            def step():
                out = layer(inputs)
                out.backward(grad)
                return out

            try:
                _sync(device)
                start = time.perf_counter()
                outputs[form] = step().detach().float()
                _sync(device)
                first = time.perf_counter() - start
                row[f"{form}_ms"] = _timed(step, device, repeat)
            except RuntimeError as error:  # a kernel this device lacks: the other forms still run
                row[f"{form}_error"] = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
                continue
            if form == "compiled":
                counters = torch._dynamo.utils.counters
                row.update(
                    compile_s=first,
                    graphs=counters["stats"]["unique_graphs"],
                    breaks=sum(counters["graph_break"].values()),
                )
        if "compiled" in outputs and "grouped" in outputs:
            row["max_gap"] = float((outputs["compiled"] - outputs["grouped"]).abs().max())
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    forms = ", ".join(
        f"{form} {row[f'{form}_ms']:.2f} ms" if f"{form}_ms" in row else f"{form}: {row[f'{form}_error']}"
        for form in ("loop", "grouped", "compiled")
    )
    tail = (
        (
            f"; compile {row['compile_s']:.1f} s, {row['graphs']} graph(s), {row['breaks']} break(s), max gap "
            f"{row.get('max_gap', float('nan')):.1e}"
        )
        if "compile_s" in row
        else ""
    )
    return f"{row['family']:<17} {row['dtype']} {row['tokens']} tokens: {forms}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="each expert's width (and the shared expert's)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: no C++ build)")
    p.add_argument("--repeat", type=int, default=10, help="timed rounds per form (the median counts)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for row in moe_block_rows(
        hidden=args.hidden,
        ffn=args.ffn,
        experts=args.experts,
        top_k=args.top_k,
        tokens=args.tokens,
        dtype=dtype,
        device=device,
        backend=args.backend,
        repeat=args.repeat,
    ):
        print(describe(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure megakit's GPU levers on one GPU in one short run (issue 21): each lever added to the last, A to F.

    python scripts/bench_gpu.py --out bench-out            # one H200: about 5 minutes
    python scripts/bench_gpu.py --dry-run --out /tmp/b     # CPU, tiny shapes, under a minute: catches typos

It runs single-process (world size 1, no ``deepspeed`` launcher: ``train`` forms a world of one
itself), so a bare GPU box needs no launcher set-up and each variant is an in-process ``train()``
through the real trainer (DeepSpeed engine, ds_config, compile, kernels), not a copy of it.

Order of the output: the environment (torch, CUDA, cuDNN, triton, torchao, liger, DeepSpeed, GPU, SM
clock); the bf16 and fp8 matmul ceilings; per shape, which attention kernel each ``--attention-kernel``
choice dispatches to (profiler kernel names) and its forward+backward time; variants A..F, each adding one
lever (``LEVERS``), then A again as the noise floor: 3 warm-up steps (the first includes compiling), 10
timed steps, median step time, tok/s, MFU (megakit's formula, printed), peak memory, final loss, and
``megakit plan``'s prediction for the same settings beside it; the CP ring's block loop at 8k and 16k local
tokens, fused against explicit (``ring_kernels``); one MoE layer per family, experts looped, grouped and compiled
(``moe_rows``); each linear-attention mixer with its CUDA kernels against its torch forms (``linear_kernel_rows``);
an fp8 parity row (30 steps bf16 vs fp8 from
one init and data, against the spread of two bf16 seeds). JSON goes to ``--out``; the table is printed last.
Step times are the trainer's own: host time between ``torch.cuda.synchronize()`` at the step's start and
end, which is what CUDA events around a whole step measure; the attention micro-benchmark and the
ceilings use CUDA events. Data: the trainer's default corpus (the standard library's bytes, fixed by the
seed), so no step runs on zeros and every variant sees the same tokens.

Install on the test H200 (Python 3.12, torch 2.11.0+cu130 and triton 3.6 preinstalled, no internet, no
DeepSpeed; at most 64 MiB carried per call). On a machine with internet, into the ignored ``.whl/``:

    pip download --no-deps -d .whl deepspeed==0.19.8          # sdist, 2 MB (no wheel on PyPI)
    pip download --no-deps -d .whl torchao==0.18.0 liger-kernel==0.8.5 nvidia-ml-py \\
        hjson ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection msgpack safetensors
    # (--python-version 3.12 --only-binary :all: --platform manylinux2014_x86_64 for the compiled ones)

then on the H200, from the repository root (carry ``.whl``):

    pip install --no-index --find-links .whl torchao liger-kernel nvidia-ml-py hjson ninja py-cpuinfo \\
        pydantic msgpack safetensors
    DS_BUILD_OPS=0 pip install --no-index --no-build-isolation --no-deps .whl/deepspeed-0.19.8.tar.gz
    pip install --no-deps --no-build-isolation -e .      # megakit itself; torch stays the image's 2.11
    python scripts/bench_gpu.py --out bench-out

(DS_BUILD_OPS=0: no CUDA op is built; megakit uses torch's fused AdamW through ``torch_adam``.)
The linear-attention rows want the ``kernels`` extra: ``pip download --no-deps -d .whl flash-linear-attention
fla-core causal-conv1d mamba-ssm einops`` (fla's are pure Python over Triton; causal-conv1d's and mamba-ssm's sdists
compile CUDA code on the GPU box: ``pip install --no-index --no-build-isolation --find-links .whl ...``, minutes);
without them those rows say "not installed".
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import json
import os
import platform
import statistics
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP, TIMED, PARITY_STEPS = 3, 10, 30

# the shapes: model preset (or a derived config), sequence length, today's micro-batch x accumulation (A)
SHAPES = {
    "tinyllama-2048": dict(model="tinyllama-1.1b", seq_len=2048, micro=4, accumulation=2),
    "tinyllama-1024": dict(
        model="tinyllama-1.1b", seq_len=1024, micro=4, accumulation=2, variants=("A", "B", "C", "D", "A2")
    ),  # the host-bound gap: E/F are memory/8B levers
    "llama3-8b-w8L-8192": dict(model="llama-3-8b", layers=8, seq_len=8192, micro=1, accumulation=2),
}
DRY_SHAPES = {  # --dry-run: the same code paths on CPU in seconds
    "tiny-64": dict(model="llama-tiny", seq_len=64, micro=2, accumulation=2, micro_tokens=192),
    "tiny-w2L-32": dict(model="llama-tiny", layers=2, seq_len=32, micro=1, accumulation=2, variants=("A",)),
}

# one lever per variant, each added to the variant before it (F-rw replaces F-tw's fp8 recipe)
LEVERS = {
    "A": ("today's defaults: micro x accumulation as measured, eager, torch AdamW, torch's SDPA choice", {}),
    "B": ("micro-batch of 16k tokens + fused AdamW", dict(micro_tokens=16384, fused_adam=True)),
    "C": ("regional torch.compile of each block", dict(compile=True)),
    "D": ("attention kernel pinned: cuDNN, K/V expanded", dict(attention_kernel="cudnn")),
    "E": ("chunked LM head + loss (8 chunks)", dict(loss_chunks=8)),
    "F-tw": ("fp8 tensorwise (torchao, large linears)", dict(fp8="tensorwise")),
    "F-rw": ("fp8 rowwise instead", dict(fp8="rowwise")),
    "A2": ("A again: the noise floor", {}),
}
ORDER = ("A", "B", "C", "D", "E", "F-tw", "F-rw", "A2")
BASE = dict(
    micro_tokens=None, fused_adam=False, compile=False, attention_kernel="torch", loss_chunks=1, fp8=None
)  # loss_chunks=1: the head and loss in one piece, as before --loss-chunks (its default is auto)


def settings(variant: str) -> dict:
    """The levers in force for ``variant``: A's, plus each later lever up to it (A2 is A)."""
    out = dict(BASE)
    if variant == "A2":
        return out
    for name in ORDER[: ORDER.index(variant) + 1]:
        if name == "F-rw":
            out.pop("fp8")
        out.update(LEVERS[name][1])
    return out


@functools.cache
def cpu_bf16_flash_runs() -> bool:
    """Whether torch's CPU flash attention takes bf16 here. Under ``ATEN_CPU_CAPABILITY=default`` on an AVX-512
    machine torch 2.13 refuses it ("pack_vnni2 is only supported when avx512 is supported": the kernel asks the
    hardware, the packing routine the capability); the dry run then times the math kernel instead."""
    import torch
    import torch.nn.functional as F

    q = torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError:
        print(
            "bench_gpu.py: torch's CPU flash attention refuses bf16 at this ATen CPU capability; the dry run uses "
            "the math kernel for torch's choice",
            flush=True,
        )
        return False
    return True


def train_kwargs(shape: dict, s: dict, *, cuda: bool, steps: int, seed: int = 0) -> tuple[dict, dict]:
    """``TrainConfig`` keywords and the ds_config for a shape under settings ``s``."""
    ds = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    micro, accumulation = shape["micro"], shape["accumulation"]
    if s["micro_tokens"]:  # the shape may scale it (the CPU dry run's tiny shapes)
        micro, accumulation = max(1, shape.get("micro_tokens", s["micro_tokens"]) // shape["seq_len"]), 1
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
    ds.pop("train_batch_size", None)
    ds["bf16"] = {"enabled": True}
    params = ds["optimizer"]["params"]
    params["torch_adam"] = True
    if not s["fused_adam"]:
        params["fused"] = False  # the trainer fuses it on CUDA unless the ds_config says otherwise
    kernel = s["attention_kernel"]
    if not cuda and (kernel in ("cudnn", "flash", "efficient") or not cpu_bf16_flash_runs()):
        kernel = "math"  # the CPU dry run exercises the pinning path with the kernel CPUs have
    kw = dict(
        ds_config=ds,
        model=shape["model_path"],
        seq_len=shape["seq_len"],
        steps=steps,
        seed=seed,
        progress=False,
        log_every=10**9,
        compile=s["compile"],
        attention_kernel=kernel,
        compile_backend="inductor" if cuda else "aot_eager",
    )
    kw.update({k: s[k] for k in ("loss_chunks", "fp8") if s.get(k)})
    return kw, dict(micro=micro, accumulation=accumulation)


def run_variant(shape: dict, s: dict, *, cuda: bool, steps: int, seed: int = 0) -> dict:
    """One in-process ``train()`` of ``steps`` steps; per-step seconds and losses, and the peak memory."""
    import torch
    import torch._dynamo

    from megakit.train.run import TrainConfig
    from megakit.train.trainer import train

    kw, batch = train_kwargs(shape, s, cuda=cuda, steps=steps, seed=seed)
    torch._dynamo.reset()  # every variant compiles afresh: no cache limit reached across variants
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    log = io.StringIO()
    with redirect_stdout(log):
        result = train(TrainConfig(**kw))
    out = dict(
        batch,
        seconds=[m.seconds for m in result.steps],
        loss=result.losses,
        tokens=result.steps[0].tokens,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    )
    del result
    return out


def planner(shape: dict, s: dict, batch: dict, gpu: str) -> dict:
    """``megakit plan``'s prediction for the same run: step time, tok/s, MFU, peak memory (one place for the flags)."""
    from megakit.commands.cli import main as megakit

    argv = [
        "plan",
        "--model",
        shape["model_path"],
        "--gpu",
        gpu,
        "--gpus",
        "1",
        "--seq-len",
        str(shape["seq_len"]),
        "--micro-batch",
        str(batch["micro"]),
        "--global-batch",
        str(batch["micro"] * batch["accumulation"]),
        "--zero",
        "0",
        "--tp",
        "1",
        "--pp",
        "1",
        "--recompute",
        "none",
        "--precision",
        "bf16",
        "--json",
    ]
    levers = ["--kernels", "compiled" if s["compile"] else "eager"]
    if s.get("fp8"):
        levers += ["--fp8", s["fp8"]]
    if s.get("loss_chunks"):
        levers += ["--loss-chunks", str(s["loss_chunks"])]
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = megakit(argv + levers)
    except SystemExit as exit_:  # argparse: a flag it refuses
        code = exit_.code
    if code != 0:
        return dict(note=f"planner failed: {err.getvalue().strip()[-200:]}")
    plan = json.loads(out.getvalue())["plan"]
    return dict(
        step_s=plan["step_time_s"],
        tokens_per_s=plan["tokens_per_s"],
        mfu=plan["mfu"],
        peak_gib=plan["peak_memory_gib"],
        note="",
    )


def measure(shape: dict, variant: str, *, cuda: bool, peak: float | None, gpu: str, warmup: int, timed: int) -> dict:
    """One table row: the variant's run and the planner's prediction beside it."""
    from megakit.core.model_config import ModelConfig
    from megakit.errors import UsageError

    s = settings(variant)
    row = dict(variant=variant, lever=LEVERS[variant][0], settings=s)
    try:
        got = run_variant(shape, s, cuda=cuda, steps=warmup + timed)
    except UsageError as error:  # a lever this device cannot run (fp8 on CPU): one line, the rest goes on
        row["skipped"] = f"refused here: {error}"
        print(f"  {variant}: {row['skipped']}", flush=True)
        return row
    except RuntimeError as error:  # out of memory, a kernel missing on this GPU: GPU time is too scarce to stop here
        row["skipped"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        print(f"  {variant}: {row['skipped']}", flush=True)
        return row
    step = statistics.median(got["seconds"][warmup:])
    flops = ModelConfig.load(shape["model_path"]).flops_per_token(shape["seq_len"])
    row.update(
        micro=got["micro"],
        accumulation=got["accumulation"],
        step_s=step,
        first_step_s=got["seconds"][0],
        tokens_per_s=got["tokens"] / step,
        loss=got["loss"][-1],
        first_loss=got["loss"][0],
        peak_gib=got["peak_gib"],
        mfu=None if peak is None else got["tokens"] / step * flops / (peak * 1e12),
        planner=planner(shape, s, got, gpu),
    )
    print(
        f"  {variant}: {step * 1e3:.1f} ms/step, {row['tokens_per_s']:,.0f} tok/s"
        + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
        + f", loss {row['loss']:.4f}",
        flush=True,
    )
    return row


def environment() -> dict:
    import torch

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    )
    from importlib.metadata import PackageNotFoundError, version

    for name in ("triton", "torchao", "liger-kernel", "deepspeed", "nvidia-ml-py"):
        try:
            env[name] = version(name)  # without importing it (torchao's import alone takes seconds)
        except PackageNotFoundError:
            env[name] = None
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())))
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            env["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        except Exception:  # noqa: BLE001
            env["sm_clock_mhz"] = None
    return env


def _cuda_ms(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` by CUDA events (perf_counter on CPU)."""
    import time

    import torch

    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings(n: int) -> dict:
    """TFLOP/s of an ``n^3`` bf16 matmul and of an fp8 (e4m3) ``torch._scaled_mm``, 10 timed runs each."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    out = dict(n=n, bf16_tflops=2 * n**3 / _cuda_ms(lambda: a @ b, 10) / 1e9)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.tensor(1.0, device=device)
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        out["fp8_tflops"] = (
            2
            * n**3
            / _cuda_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10)
            / 1e9
        )
    except Exception as error:  # noqa: BLE001 (no fp8 GEMM on this device)
        out["fp8_tflops"], out["fp8_note"] = None, str(error).splitlines()[0][:120]
    return out


def attention_kernels(shape: dict, micro: int, *, cuda: bool) -> list[dict]:
    """Per ``--attention-kernel`` choice: the kernels the profiler saw for this shape's attention, fwd+bwd ms."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from megakit.core.model_config import ModelConfig
    from megakit.errors import UsageError
    from megakit.nn.attention.kernels import attention_kernels_in, choose_kernel

    config = ModelConfig.load(shape["model_path"])
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    capability = torch.cuda.get_device_capability() if cuda else None
    q = torch.randn(
        micro, config.heads, shape["seq_len"], config.head_dim, device=device, dtype=dtype, requires_grad=True
    )
    kv = torch.randn(
        micro, config.kv_heads, shape["seq_len"], config.head_dim, device=device, dtype=dtype, requires_grad=True
    )
    rows = []
    for name in ("torch", "auto", "flash", "cudnn", "efficient", "math"):
        try:
            choice = choose_kernel(name, cuda=cuda, capability=capability)
        except UsageError as error:
            rows.append(dict(choice=name, error=str(error)))
            continue
        groups = config.heads // config.kv_heads

        def step():
            k = kv.repeat_interleave(groups, dim=1) if choice.expand_kv else kv
            with choice.context():
                y = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=not choice.expand_kv)
                y.sum().backward()

        try:
            step()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                step()
            rows.append(
                dict(
                    choice=name,
                    kernels=attention_kernels_in(e.key for e in prof.key_averages()),
                    fwd_bwd_ms=_cuda_ms(step, 5),
                )
            )
        except RuntimeError as error:
            rows.append(dict(choice=name, error=str(error).splitlines()[0][:160]))
    return rows


def document_kernels(shape: dict, micro: int, *, cuda: bool) -> list[dict]:
    """Packed documents (lengths drawn around S/8): SDPA with the boolean mask against FlexAttention's block mask
    (``megakit.nn.attention.masks``, what ``auto`` runs on the GPU), fwd+bwd ms and the outputs' largest gap. On CPU
    FlexAttention has no backward: forward only."""
    import torch
    import torch.nn.functional as F

    from megakit.core.model_config import ModelConfig
    from megakit.nn.attention.masks import allowed_keys, flex_document_attention

    config, s = ModelConfig.load(shape["model_path"]), shape["seq_len"]
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    starts = (torch.rand(micro, s, generator=gen) < 8 / s).long()
    starts[:, 0] = 0
    docs = starts.cumsum(-1).to(device)
    q = torch.randn(micro, config.heads, s, config.head_dim, generator=gen).to(device, dtype).requires_grad_(cuda)
    kv = torch.randn(micro, config.kv_heads, s, config.head_dim, generator=gen).to(device, dtype).requires_grad_(cuda)
    mask = allowed_keys(s, 0, docs, device)
    kept = float(mask.float().mean() / torch.ones(s, s).tril().mean())
    kernels = {
        "sdpa-mask": lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True),
        "flex": lambda: flex_document_attention(q, kv, kv, docs, window=0, scale=config.head_dim**-0.5),
    }
    outputs, rows = {}, []
    for name, attend in kernels.items():

        def step():
            y = attend()
            if cuda:
                y.sum().backward()
            return y

        try:
            outputs[name] = step().detach().float()
            rows.append(dict(choice=f"documents {name}", kept_pairs=kept, fwd_bwd_ms=_cuda_ms(step, 5)))
        except RuntimeError as error:
            rows.append(dict(choice=f"documents {name}", error=str(error).splitlines()[0][:160]))
    if len(outputs) == 2:
        rows[-1]["max_gap"] = float((outputs["flex"] - outputs["sdpa-mask"]).abs().max())
    return rows


def ring_kernels(*, cuda: bool) -> list[dict]:
    """One CP rank's ring block loop (a ring of one: its own block, the diagonal every rank computes), the fused
    chunk pairs (``attention.blocks._FusedBlockAttention``: on CUDA the memory-efficient kernel) against the
    explicit fp32 blocks (``_BlockAttention``), at 8k and 16k local tokens, 8 query heads over 2 KV heads of 128
    (Llama-3-8B at TP 4),
    bf16: fwd+bwd ms, peak GiB, and the fused output's and dq's largest gap to the explicit ones."""
    import torch

    from megakit.nn.attention.ring import ring_attention

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []
    for tokens in (8192, 16384) if cuda else (256, 512):
        gen = torch.Generator().manual_seed(tokens)
        q = torch.randn(1, 8, tokens, 128, generator=gen).to(device, dtype).requires_grad_()
        k, v = (torch.randn(1, 2, tokens, 128, generator=gen).to(device, dtype).requires_grad_() for _ in "kv")
        grad = torch.randn(1, 8, tokens, 128, generator=gen).to(device, dtype)
        got = {}
        for name, fused in (("fused", True), ("explicit", False)):

            def step():
                for t in (q, k, v):
                    t.grad = None
                y = ring_attention(q, k, v, None, fused=fused)
                y.backward(grad)
                return y

            try:
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                got[name] = (step().detach().float(), q.grad.float())
                ms = _cuda_ms(step, 3)
                peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
                rows.append(dict(choice=f"ring {name}", local_tokens=tokens, fwd_bwd_ms=ms, peak_gib=peak))
            except (RuntimeError, torch.OutOfMemoryError) as error:
                rows.append(dict(choice=f"ring {name}", local_tokens=tokens, error=str(error).splitlines()[0][:160]))
        if len(got) == 2:
            rows[-2]["max_gap_out"] = float((got["fused"][0] - got["explicit"][0]).abs().max())
            rows[-2]["max_gap_dq"] = float((got["fused"][1] - got["explicit"][1]).abs().max())
    return rows


def moe_rows(*, cuda: bool) -> list[dict]:
    """One MoE layer per family (``scripts/bench_moe_block.py``), forward + backward: the experts looped (their
    counts copied to the host), grouped over device offsets, and compiled whole (Inductor); DeepSeek-V2-Lite's
    widths (2048, 64 experts of 1408, top-6) at 8192 tokens in bf16 on the GPU, tiny and fp32 in the dry run."""
    import torch
    from bench_moe_block import moe_block_rows

    if cuda:
        return moe_block_rows(
            hidden=2048,
            ffn=1408,
            experts=64,
            top_k=6,
            tokens=8192,
            dtype=torch.bfloat16,
            device="cuda",
            backend="inductor",
            repeat=10,
        )
    return moe_block_rows(hidden=64, ffn=32, experts=4, top_k=2, tokens=128, backend="aot_eager", repeat=2)


def linear_kernel_rows(*, cuda: bool) -> list[dict]:
    """Each linear-attention mixer (Gated DeltaNet, Mamba-2; ``scripts/bench_linear_attention.py``'s shapes) forward
    + backward with the CUDA kernels (``--linear-attention-kernels auto``: flash-linear-attention, causal-conv1d,
    mamba-ssm) and with megakit's torch forms, on the same weights and inputs, three packed documents per row: both
    times, the output's and the input gradient's largest gap. Width 2048 at 2 x 8192 tokens in bf16 on the GPU;
    there a mixer whose packages do not import gets a "not installed" row. The dry run (CPU, tiny, fp32) runs the
    torch forms both ways: the kernels need CUDA."""
    import torch
    from bench_linear_attention import _build

    from megakit.nn.linear_attention import kernels

    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    hidden, seq, batch = (2048, 8192, 2) if cuda else (64, 256, 2)
    position = torch.arange(seq, device=device)
    documents = ((position >= seq // 5).long() + (position >= seq // 2).long()).expand(batch, seq)  # (B, S)
    rows = []
    for kind, packages in (
        ("gdn", ("flash-linear-attention", "causal-conv1d")),
        ("mamba2", ("causal-conv1d", "mamba-ssm")),
    ):
        missing = [p for p in packages if kernels.imported(p) is None]
        if cuda and missing:
            rows.append(
                dict(mixer=kind, skipped=f"{', '.join(missing)} not installed (pip install 'megakit[kernels]')")
            )
            continue
        mixer = _build(kind, hidden, seq, dtype, device)
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(seq, batch, hidden, generator=gen).to(device, dtype).requires_grad_()
        grad = torch.randn(seq, batch, hidden, generator=gen).to(device, dtype)
        row, got = dict(mixer=kind, tokens=seq * batch, documents=3), {}
        for choice in ("auto", "torch"):
            kernels.use_linear_kernels(mixer, choice)

            def step():
                x.grad = None
                y = mixer(x, documents)
                y.backward(grad)
                return y

            try:
                got[choice] = (step().detach().float(), x.grad.float())
                row[f"{choice}_ms"] = _cuda_ms(step, 3)
            except Exception as error:  # a kernel's refusal of any kind is this row's, not the run's end
                row[f"{choice}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if len(got) == 2:
            row["max_gap_out"] = float((got["auto"][0] - got["torch"][0]).abs().max())
            row["max_gap_dx"] = float((got["auto"][1] - got["torch"][1]).abs().max())
            row["scale_out"] = float(got["torch"][0].abs().max())
        rows.append(row)
    return rows


def describe_linear(row: dict) -> str:
    """One line of ``linear_kernel_rows``: the skip, or both times and the gaps."""
    if "skipped" in row:
        return f"{row['mixer']}: {row['skipped']}: the kernels are unchecked"
    times = ", ".join(
        f"{c} {row[f'{c}_ms']:.2f} ms" if f"{c}_ms" in row else f"{c} {row[f'{c}_error']}" for c in ("auto", "torch")
    )
    gaps = (
        f", max gap out {row['max_gap_out']:.2e} (of {row['scale_out']:.2e}), dx {row['max_gap_dx']:.2e}"
        if "max_gap_out" in row
        else ""
    )
    return f"{row['mixer']} kernels (auto) vs torch forms, fwd+bwd of {row['tokens']} tokens: {times}{gaps}"


def describe_moe(row: dict) -> str:
    from bench_moe_block import describe

    return describe(row)


def parity(shape: dict, *, cuda: bool, steps: int) -> dict:
    """bf16 against fp8 (tensorwise) from one init and data, judged against two bf16 runs with other seeds."""
    s = settings("E")
    fp8 = dict(s, fp8="tensorwise")
    from megakit.errors import UsageError

    tail = max(1, steps // 3)
    try:
        runs = {
            name: run_variant(shape, cfg, cuda=cuda, steps=steps, seed=seed)["loss"]
            for name, cfg, seed in (("fp8", fp8, 0), ("bf16", s, 0), ("bf16_seed1", s, 1))
        }
    except UsageError as error:
        return dict(skipped=f"refused here: {error}")
    last = {name: statistics.fmean(loss[-tail:]) for name, loss in runs.items()}
    return dict(
        steps=steps,
        mean_last=last,
        fp8_gap=abs(last["fp8"] - last["bf16"]),
        bf16_spread=abs(last["bf16_seed1"] - last["bf16"]),
        nan=any(x != x for loss in runs.values() for x in loss),
    )


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def table(results: dict) -> str:
    """The measured rows, the planner's MFU and its step time over the measured one beside each."""
    head = (
        f"{'shape':<20} {'var':<5} {'micro':>5} {'ms/step':>9} {'tok/s':>9} {'MFU':>6} {'plan MFU':>8} "
        f"{'plan/meas':>9} {'peak GiB':>8} {'1st step s':>10} {'loss':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, shape in results["shapes"].items():
        for row in shape["variants"]:
            if "skipped" in row:
                lines.append(f"{name:<20} {row['variant']:<5} {row['skipped']}")
                continue
            plan = row["planner"]
            ratio = plan["step_s"] / row["step_s"] if plan.get("step_s") else None
            lines.append(
                f"{name:<20} {row['variant']:<5} {row['micro']:>5} {row['step_s'] * 1e3:>9.1f} "
                f"{row['tokens_per_s']:>9,.0f} {_pct(row['mfu']):>6} {_pct(plan.get('mfu')):>8} "
                f"{_num(ratio, '.2f'):>9} {_num(row['peak_gib'], '.1f'):>8} {row['first_step_s']:>10.1f} "
                f"{row['loss']:>7.4f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for bench_gpu.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few steps: the whole script in seconds")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    p.add_argument("--variants", default=None, help="comma-separated subset of A,B,C,D,E,F-tw,F-rw,A2")
    p.add_argument("--gpu", default="h200-141gb", help="the planner's GPU preset for the predictions")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.train.observe.metrics import gpu_peak_tflops

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench_gpu.py: error: no CUDA GPU here; pass --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    warmup, timed, parity_steps = (1, 2, 4) if args.dry_run else (WARMUP, TIMED, PARITY_STEPS)
    for name, shape in shapes.items():  # derived configs (fewer layers) as files the planner reads too
        config = ModelConfig.load(shape["model"])
        if shape.get("layers"):
            config = config.replace(layers=shape["layers"])
        shape["model_path"] = str(out_dir / f"{name}.json")
        Path(shape["model_path"]).write_text(json.dumps(config.to_hf()))
    peak = gpu_peak_tflops() if cuda else None

    def save(results: dict) -> None:
        tmp = out_dir / ".bench_gpu.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(out_dir / "bench_gpu.json")

    results = dict(
        environment=environment(),
        mfu_formula="MFU = tokens/s x (6N + 12 L q S) / peak "
        f"(N: block matrices + LM head; q = heads x head_dim; peak {peak} TFLOP/s)",
        shapes={},
    )
    print("environment:", json.dumps(results["environment"]), flush=True)
    print(results["mfu_formula"], flush=True)
    results["ceilings"] = ceilings(8192 if cuda else 64)  # CPU: torchao's emulated fp8 GEMM takes 1 s at 256
    print("ceilings:", json.dumps(results["ceilings"]), flush=True)
    for name, shape in shapes.items():
        print(f"{name}:", flush=True)
        wanted = [v for v in shape.get("variants", ORDER) if not args.variants or v in args.variants.split(",")]
        kernels = attention_kernels(shape, shape["micro"], cuda=cuda)
        for row in kernels:
            print(
                f"  attention {row['choice']}: "
                + (row.get("error") or f"{', '.join(row['kernels'])} ({row['fwd_bwd_ms']:.2f} ms fwd+bwd)"),
                flush=True,
            )
        kernels += document_kernels(shape, shape["micro"], cuda=cuda)
        for row in kernels[-2:]:
            print(
                f"  attention {row['choice']}: "
                + (
                    row.get("error")
                    or f"{row['fwd_bwd_ms']:.2f} ms {'fwd+bwd' if cuda else 'fwd'}, {row['kept_pairs']:.0%} of causal "
                    f"pairs kept"
                    + (f", max gap to SDPA {row['max_gap']:.2e}" if "max_gap" in row else "")
                ),
                flush=True,
            )
        rows = []
        results["shapes"][name] = dict(
            seq_len=shape["seq_len"], model=shape["model"], layers=shape.get("layers"), attention=kernels, variants=rows
        )
        for variant in wanted:
            rows.append(measure(shape, variant, cuda=cuda, peak=peak, gpu=args.gpu, warmup=warmup, timed=timed))
            save(results)  # after every row: a run cut short still leaves what it measured
    results["ring"] = ring_kernels(cuda=cuda)
    for row in results["ring"]:
        print(
            f"  {row['choice']} at {row['local_tokens']} local tokens: "
            + (
                row.get("error")
                or f"{row['fwd_bwd_ms']:.2f} ms fwd+bwd, peak {_num(row['peak_gib'], '.2f')} GiB"
                + (
                    f", max gap to explicit: out {row['max_gap_out']:.2e}, dq {row['max_gap_dq']:.2e}"
                    if "max_gap_out" in row
                    else ""
                )
            ),
            flush=True,
        )
    save(results)
    results["moe"] = moe_rows(cuda=cuda)
    for row in results["moe"]:
        print(f"  moe {describe_moe(row)}", flush=True)
    save(results)
    results["linear_attention"] = linear_kernel_rows(cuda=cuda)
    for row in results["linear_attention"]:
        print(f"  linear attention {describe_linear(row)}", flush=True)
    save(results)
    results["fp8_parity"] = parity(next(iter(shapes.values())), cuda=cuda, steps=parity_steps)
    print("fp8 parity:", json.dumps(results["fp8_parity"]), flush=True)
    save(results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

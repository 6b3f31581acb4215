"""The GPU levers' CPU-checkable parts: the attention-kernel choice, K/V expansion, the profiler naming the kernel,
fused AdamW on CUDA only, GPU figures absent on CPU, and the CLI's one-line refusals."""

import subprocess
import sys

import pytest
import torch
from paths import ROOT
from torch.nn.attention import SDPBackend

from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.nn.attention.kernels import attention_kernels_in, choose_kernel, use_kernel
from megakit.nn.model import Transformer
from megakit.train.engine.ds_config import fuse_adam, read_ds_config
from megakit.train.observe.metrics import StepMetrics, gpu_state


def test_kernel_choice_per_device():
    assert choose_kernel("auto", cuda=False).backends == ()  # CPU: torch's own choice, as before
    assert choose_kernel("auto", cuda=True, capability=(8, 0)).backends == ()  # A100: torch's choice
    hopper = choose_kernel("auto", cuda=True, capability=(9, 0))
    assert hopper.backends[0] == SDPBackend.CUDNN_ATTENTION and hopper.expand_kv
    flash = choose_kernel("flash", cuda=True)
    assert flash.backends == (SDPBackend.FLASH_ATTENTION,) and not flash.expand_kv  # FA2 takes GQA as it is
    assert choose_kernel("math", cuda=False).backends == (SDPBackend.MATH,)
    for name in ("flash", "cudnn", "efficient"):
        with pytest.raises(UsageError, match=f"--attention-kernel {name} needs a CUDA GPU"):
            choose_kernel(name, cuda=False)


def test_expanded_kv_gives_the_same_attention_and_the_profiler_names_the_kernel():
    """llama-tiny has GQA (8 query heads, 4 KV heads): expanding K/V changes nothing but the call; under ``math``
    the profiler's op names say that the math kernel ran, under torch's choice on CPU the CPU flash kernel."""
    from torch.profiler import ProfilerActivity, profile

    model = Transformer(ModelConfig.load("llama-tiny"), seed=0).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as torch_choice:
        plain = model(ids)
    use_kernel(model, choose_kernel("efficient", cuda=True))  # K/V expanded, as cuDNN and efficient get them
    pinned = choose_kernel("math", cuda=False).context()
    with torch.no_grad(), pinned, profile(activities=[ProfilerActivity.CPU]) as math:
        expanded = model(ids)
    assert torch.allclose(plain, expanded, atol=1e-6)
    ran = attention_kernels_in(e.key for e in math.key_averages())
    assert any("math" in name for name in ran) and not any("flash" in name for name in ran), ran
    assert any("flash" in name for name in attention_kernels_in(e.key for e in torch_choice.key_averages()))


def test_adam_is_fused_on_cuda_only_and_a_ds_config_choice_wins():
    config = read_ds_config(str(ROOT / "ds_configs" / "zero1.json"))
    on_cpu = read_ds_config(config)
    fuse_adam(on_cpu, cuda=False)
    assert on_cpu == config  # the CPU path is unchanged
    fuse_adam(config, cuda=True)
    assert config["optimizer"]["params"]["fused"] is True
    explicit = read_ds_config(str(ROOT / "ds_configs" / "zero1.json"))
    explicit["optimizer"]["params"]["foreach"] = True  # torch refuses fused with foreach: the user's choice stays
    fuse_adam(explicit, cuda=True)
    assert "fused" not in explicit["optimizer"]["params"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side: GPU figures are absent")
def test_gpu_figures_are_absent_on_cpu_not_zero():
    assert gpu_state() == (None, None)
    m = StepMetrics(
        step=0,
        loss=1.0,
        lr=0.0,
        grad_norm=1.0,
        seconds=1.0,
        samples=1,
        tokens=1,
        flops=1.0,
        comm_seconds=None,
        comm_calls=0,
        world_size=1,
        peak_tflops=None,
    )
    assert "GPU" not in m.line() and "perf/gpu_util" not in m.scalars() and m.to_dict()["gpu_util"] is None
    gpu = StepMetrics(
        step=0,
        loss=1.0,
        lr=0.0,
        grad_norm=1.0,
        seconds=1.0,
        samples=1,
        tokens=1,
        flops=1.0,
        comm_seconds=None,
        comm_calls=0,
        world_size=1,
        peak_tflops=None,
        gpu_util=87.0,
        gpu_mem_gib=41.25,
        compiling=True,
    )
    assert "GPU util 87%" in gpu.line() and "GPU mem 41.2 GiB" in gpu.line() and "(incl. compile)" in gpu.line()
    assert gpu.scalars()["perf/gpu_util"] == 87.0 and gpu.scalars()["perf/gpu_mem_gib"] == 41.25


@pytest.mark.skipif(torch.cuda.is_available(), reason="flash is a valid choice on a GPU")
def test_a_cuda_kernel_on_cpu_is_refused_in_one_line():
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--attention-kernel", "flash", "--steps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert lines == [
        "train.py: error: --attention-kernel flash needs a CUDA GPU; on CPU use auto (torch's choice) or math"
    ], out.stderr[-2000:]


def test_compile_defaults_on_cuda_only_moe_included():
    from megakit.nn.compile import default_compile

    assert default_compile("cuda") and not default_compile("cpu")
    assert not default_compile("cuda", cp=2)  # MoE blocks compile whole (test_compile): no longer an exception
    assert not default_compile("cuda", zero_stage=3)  # its hooks gather inside the block: --compile is refused there

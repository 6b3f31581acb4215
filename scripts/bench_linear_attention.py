"""Benchmark: the Gated DeltaNet and Mamba-2 mixers against full attention of one width, and against transformers'.

One process, fp32 (bf16 on a GPU), batch 1. For each sequence length (default 2k, 8k, 32k tokens) it times forward +
backward of megakit's ``GatedDeltaNet`` and of megakit's causal ``Attention`` (SDPA) of the same hidden width, and
measures each one's peak memory: on a GPU ``torch.cuda.max_memory_allocated``, on the CPU the growth of the peak
resident set of a fresh child process that runs only that case (torch's CPU allocator keeps no peak of its own).
The GDN's time and memory grow linearly with the sequence (chunks of 64), attention's time quadratically (its
memory is linear too where SDPA's fused kernels run); Mamba-2's likewise (chunks of 128, Nemotron-H's). Then megakit's
mixer against transformers' ``Qwen3NextGatedDeltaNet`` (its torch fallback: no flash-linear-attention here), same
weights, at the first length; and Mamba-2 against ``NemotronHMamba2Mixer``'s torch path.

    python scripts/bench_linear_attention.py                          # hidden 128, minutes on two CPU cores
    python scripts/bench_linear_attention.py --hidden 2048 --lengths 4096 16384 65536   # on a GPU

Prints one row per (mixer, length): ms per forward + backward and peak MiB; then ``growth`` of both from the first
length to the last against the length ratio; then ``ratio <megakit / transformers>`` of the GDN time (target <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megakit.core.linear_attention_config import LinearAttentionConfig  # noqa: E402
from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.nn.attention.core import Attention, rope_tables  # noqa: E402
from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet  # noqa: E402
from megakit.nn.linear_attention.mamba2 import Mamba2  # noqa: E402

KINDS = ("gdn", "mamba2", "attention")  # Mamba-2 rows: Nemotron-H's mixer (megakit.nn.linear_attention.mamba2)


def _mamba(hidden: int):
    """Nemotron-H 8B's proportions: inner width twice the hidden, state twice the head dim, 8 groups, chunks of 128."""
    from megakit.core.mamba_config import Mamba2Config

    d = max(hidden // 16, 8)
    heads = 2 * hidden // d
    return Mamba2Config(heads=heads, head_dim=d, state=2 * d, groups=min(8, heads), chunk=128)


def _linear(hidden: int) -> LinearAttentionConfig:
    """Qwen3-Next's proportions: value heads twice the key heads, head dims 128 (here hidden / 16)."""
    d = max(hidden // 16, 8)
    return LinearAttentionConfig(key_heads=hidden // (2 * d), value_heads=hidden // d, key_head_dim=d, value_head_dim=d)


def _build(kind: str, hidden: int, seq: int, dtype, device):
    torch.manual_seed(0)
    if kind == "mamba2":
        mixer = Mamba2(
            _mamba(hidden),
            hidden,
            eps=1e-5,
            group=None,
            sequence_parallel=False,
            dtype=dtype,
            device=device,
            cp_group=None,
        )
    elif kind == "gdn":
        mixer = GatedDeltaNet(
            _linear(hidden), hidden, eps=1e-6, group=None, sequence_parallel=False, dtype=dtype, device=device
        )
    else:
        config = ModelConfig(
            family="llama",
            vocab_size=256,
            max_seq_len=seq,
            hidden=hidden,
            layers=1,
            heads=hidden // 64 or 1,
            kv_heads=hidden // 64 or 1,
            ffn=4 * hidden,
        )
        mixer = Attention(config, group=None, sequence_parallel=False, site="bench", dtype=dtype, device=device)
        mixer.rope_table = tuple(t.to(dtype) for t in rope_tables(config, device))
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.5))
    return mixer


def _step(kind: str, mixer, x):
    y = mixer(x) if kind in ("gdn", "mamba2") else mixer(x, mixer.rope_table, None)
    y.float().square().mean().backward()


def _time(fn, repeats: int, device, warm: bool = False) -> float:
    if not warm:
        fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_case(kind: str, hidden: int, seq: int, repeats: int) -> dict:
    """Time and peak memory of one mixer at one length, in this process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mixer = _build(kind, hidden, seq, dtype, device)
    x = torch.randn(seq, 1, hidden, dtype=dtype, device=device, requires_grad=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _step(kind, mixer, x)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**10  # KiB -> MiB
    ms = _time(lambda: _step(kind, mixer, x), repeats, device, warm=True)  # the memory run warmed it
    return {"kind": kind, "seq": seq, "ms": ms, "peak_mib": peak}


def _in_child(kind: str, hidden: int, seq: int, repeats: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--case",
            kind,
            "--hidden",
            str(hidden),
            "--lengths",
            str(seq),
            "--repeats",
            str(repeats),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def against_transformers(hidden: int, seq: int, repeats: int) -> tuple[float, float]:
    """ms per forward + backward of transformers' torch-path module and of megakit's, same weights, ``(S, B, H)``."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    linear = _linear(hidden)
    config = Qwen3NextConfig(
        hidden_size=hidden,
        linear_num_key_heads=linear.key_heads,
        linear_num_value_heads=linear.value_heads,
        linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).float()
    ours = _build("gdn", hidden, seq, torch.float32, None)
    x = torch.randn(1, seq, hidden, requires_grad=True)
    xs = x.detach().transpose(0, 1).contiguous().requires_grad_()

    def theirs():
        hf(x).square().mean().backward()

    def mine():
        ours(xs).square().mean().backward()

    t_hf, t_ours = [], []
    for _ in range(repeats):  # alternate, so machine load hits both alike
        t_hf.append(_time(theirs, 1, torch.device("cpu")))
        t_ours.append(_time(mine, 1, torch.device("cpu")))
    return min(t_hf), min(t_ours)


def mamba_against_transformers(hidden: int, seq: int, repeats: int) -> tuple[float, float]:
    """``against_transformers`` for Mamba-2: transformers' ``NemotronHMamba2Mixer`` (its torch path, in eval mode:
    in training it calls the fused mamba_ssm kernel's stub first) and megakit's, same weights."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from megakit.interop.hf_mamba import mixer_from_hf

    m = _mamba(hidden)
    config = NemotronHConfig(hidden_size=hidden, layers_block_type=["linear_attention"], **m.to_hf())
    torch.manual_seed(0)
    hf = NemotronHMamba2Mixer(config, layer_idx=0).float().eval()
    ours = _build("mamba2", hidden, seq, torch.float32, None)
    ours.load_state_dict(mixer_from_hf(hf.state_dict(), m))
    x = torch.randn(1, seq, hidden, requires_grad=True)
    xs = x.detach().transpose(0, 1).contiguous().requires_grad_()
    t_hf, t_ours = [], []
    for _ in range(repeats):  # alternate, so machine load hits both alike
        t_hf.append(_time(lambda: hf(x).square().mean().backward(), 1, torch.device("cpu")))
        t_ours.append(_time(lambda: ours(xs).square().mean().backward(), 1, torch.device("cpu")))
    return min(t_hf), min(t_ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="mixer width (default: %(default)s)")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[2048, 8192, 32768], help="sequence lengths (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed repeats per case, best kept (default: %(default)s)"
    )
    parser.add_argument("--case", choices=KINDS, help=argparse.SUPPRESS)  # one case, in a child
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.case:
        print(json.dumps(run_case(args.case, args.hidden, args.lengths[0], args.repeats)))
        return
    rows = {}
    for kind in KINDS:
        for seq in args.lengths:
            rows[kind, seq] = row = _in_child(kind, args.hidden, seq, args.repeats)
            print(f"{kind:9} S={seq:6}  {row['ms']:10.1f} ms fwd+bwd  {row['peak_mib']:8.1f} MiB peak", flush=True)
    first, last = args.lengths[0], args.lengths[-1]
    for kind in KINDS:
        a, b = rows[kind, first], rows[kind, last]
        print(
            f"growth {kind:9} x{last / first:.0f} tokens: time x{b['ms'] / a['ms']:.1f}, "
            f"memory x{b['peak_mib'] / max(a['peak_mib'], 1e-3):.1f}"
        )
    hf_ms, ours_ms = against_transformers(args.hidden, first, max(args.repeats, 3))
    print(f"transformers torch path S={first}: {hf_ms:.1f} ms, megakit {ours_ms:.1f} ms")
    print(f"ratio {ours_ms / hf_ms:.2f} <megakit / transformers>")
    hf_ms, ours_ms = mamba_against_transformers(args.hidden, first, max(args.repeats, 3))
    print(f"Mamba-2: transformers torch path S={first}: {hf_ms:.1f} ms, megakit {ours_ms:.1f} ms")
    print(f"ratio {ours_ms / hf_ms:.2f} <megakit / transformers> (Mamba-2)")


if __name__ == "__main__":
    main()

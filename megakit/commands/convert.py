"""``megakit convert CHECKPOINT --to-hf OUT_DIR``: a megakit checkpoint to transformers' layout.

Single process, any saved TP x PP layout; see ``megakit.interop.hf_export``.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a directory written by megakit's save_checkpoint")
    parser.add_argument("--to-hf", metavar="OUT_DIR", required=True,
                        help="write config.json and model.safetensors here (a new or empty directory)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="split the weights into files of at most this size, as transformers does (default 5)")


def run(args: argparse.Namespace) -> int:
    from megakit.errors import UsageError
    from megakit.interop.hf_export import export_hf

    if args.max_shard_gb <= 0:
        raise UsageError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    summary = export_hf(args.checkpoint, args.to_hf, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote {args.to_hf}: {', '.join(summary['files'])} + config.json "
          f"({summary['params'] / 1e6:.2f} M parameters, {summary['dtype']}, {summary['bytes'] / 2**20:.1f} MiB) "
          f"from step {summary['step']}")
    print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(args.to_hf)!r})")
    return 0

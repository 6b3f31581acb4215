"""``megakit convert``: between a megakit checkpoint and transformers' layout, both ways.

    megakit convert CHECKPOINT OUT_DIR --to-hf      # megakit -> transformers (any saved TP x PP layout)
    megakit convert HF_DIR OUT_DIR --from-hf        # transformers (safetensors) -> megakit, step 0

One shape for both directions; the older ``CHECKPOINT --to-hf OUT_DIR`` still works.

Single process; see ``megakit.interop.hf_export`` and ``megakit.interop.hf_import``.
"""

from __future__ import annotations

import argparse

from megakit.errors import finite_float


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds ``megakit convert``'s flags (each command module owns its own, so ``cli`` stays a table)."""
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="a megakit checkpoint directory or a --keep series, whose newest intact checkpoint is "
        "taken (with --to-hf); or a transformers directory (with --from-hf)",
    )
    parser.add_argument(
        "out",
        metavar="OUT_DIR",
        nargs="?",
        default=None,
        help="where to write: the transformers directory (--to-hf) or the megakit checkpoint "
        "(--from-hf); a new or empty directory",
    )
    parser.add_argument(
        "--to-hf",
        metavar="OUT_DIR",
        nargs="?",
        const=True,
        default=None,
        help="SOURCE is a megakit checkpoint: write config.json and model.safetensors to OUT_DIR "
        "(given before or, as before, after --to-hf)",
    )
    parser.add_argument(
        "--from-hf",
        action="store_true",
        help="SOURCE is a transformers checkpoint (config.json + safetensors): write it to OUT_DIR "
        "as a megakit checkpoint that train.py --load starts from at any layout",
    )
    parser.add_argument(
        "--max-shard-gb",
        type=finite_float,
        default=5.0,
        help="with --to-hf: split the weights into files of at most this size, as transformers does",
    )


def run(args: argparse.Namespace) -> int:
    """Converts one checkpoint between megakit and transformers; UsageError names a bad flag."""
    from megakit.errors import UsageError

    to_hf = args.to_hf is not None
    if isinstance(args.to_hf, str):  # the older CHECKPOINT --to-hf OUT_DIR
        args.out = None if args.out else args.to_hf
    if to_hf == bool(args.from_hf) or not args.out:
        raise UsageError("give either CHECKPOINT OUT_DIR --to-hf, or HF_DIR OUT_DIR --from-hf")
    if args.from_hf:
        from pathlib import Path

        from megakit.interop.hf_import import import_hf
        from megakit.interop.tokenizer import check_model_stop_ids, model_tokenizer, save_tokenizer
        from megakit.train.resilience.resume import TOKENIZER

        check_model_stop_ids(args.source)
        tokenizer = model_tokenizer(args.source, say=lambda line: print(f"convert: {line}"))
        summary = import_hf(args.source, args.out)
        if tokenizer is not None:  # with its chat template and stop ids, so the import exports and chats as it is
            save_tokenizer(tokenizer, Path(args.out) / TOKENIZER, source=args.source)
        print(
            f"wrote {args.out}: a megakit checkpoint at step 0 ({summary['model_type']}, "
            f"{summary['params'] / 1e6:.2f} M parameters, {summary['dtype']})"
            f"{' and its tokenizer' if tokenizer is not None else ''} from {args.source}"
        )
        print(f"train from it with: deepspeed scripts/train.py --model {args.source} --load {args.out} ...")
        return 0
    from megakit.interop.hf_export import export_hf
    from megakit.train.resilience.resume import choose_checkpoint

    if args.max_shard_gb <= 0:
        raise UsageError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    checkpoint = choose_checkpoint(args.source, doing="converting")  # a --keep series: its newest intact one
    summary = export_hf(checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(
        f"wrote {args.out}: {', '.join(summary['files'])} + config.json "
        f"({summary['params'] / 1e6:.2f} M parameters, {summary['dtype']}, {summary['bytes'] / 2**20:.1f} MiB) "
        f"from step {summary['step']} of {checkpoint}"
    )
    print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    if summary["tokenizer"]:
        print(f"with its tokenizer: transformers.pipeline('text-generation', model={str(args.out)!r})")
    return 0

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
        "--adapter",
        action="store_true",
        help="with --to-hf: write the LoRA adapters of CHECKPOINT as a peft adapter (adapter_config.json, "
        "adapter_model.safetensors), what a LoRA checkpoint exports by default; refused for one without adapters",
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="with --to-hf of a LoRA checkpoint: write the whole model with the adapters merged into its base "
        "(W + alpha/r B A) instead of the adapter",
    )
    parser.add_argument(
        "--from-peft",
        metavar="BASE",
        default=None,
        help="SOURCE is a peft LoRA adapter trained on the model of megakit checkpoint BASE: write it to OUT_DIR "
        "as a LoRA checkpoint that train.py --load continues at any layout",
    )
    parser.add_argument(
        "--max-shard-gb",
        type=finite_float,
        default=5.0,
        help="with --to-hf: split the weights into files of at most this size, as transformers does",
    )


def run(args: argparse.Namespace) -> int:
    from megakit.errors import UsageError

    to_hf = args.to_hf is not None
    if isinstance(args.to_hf, str):  # the older CHECKPOINT --to-hf OUT_DIR
        args.out = None if args.out else args.to_hf
    if args.from_peft:
        return _from_peft(args)
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
    from megakit.interop.checkpoint_format import read_manifest
    from megakit.interop.hf_export import export_hf
    from megakit.train.resilience.resume import choose_checkpoint

    if args.max_shard_gb <= 0:
        raise UsageError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    checkpoint = choose_checkpoint(args.source, doing="converting")  # a --keep series: its newest intact one
    if args.adapter or args.merged or read_manifest(checkpoint)["extra"].get("lora"):
        return _lora_to_hf(args, checkpoint)
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


def _lora_to_hf(args: argparse.Namespace, checkpoint) -> int:
    """A LoRA checkpoint: its peft adapter, or with ``--merged`` the whole model with the adapters merged in."""
    from megakit.errors import UsageError
    from megakit.interop.hf_export import export_hf
    from megakit.interop.peft import export_adapter, merge_source

    if args.adapter and args.merged:
        raise UsageError("--adapter writes the adapter alone and --merged the merged model; give one of them")
    if args.merged:
        base, _, _ = merge_source(checkpoint)
        summary = export_hf(base, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30), lora=checkpoint)
        print(
            f"wrote {args.out}: the model of {base} with the adapters of {checkpoint} merged "
            f"({summary['params'] / 1e6:.2f} M parameters, {summary['dtype']})"
        )
        return 0
    summary = export_adapter(checkpoint, args.out)
    print(
        f"wrote {args.out}: a peft LoRA adapter ({summary['adapters']} layers, {summary['params']} parameters) from "
        f"step {summary['step']} of {checkpoint}"
    )
    print(f"load it with peft.PeftModel.from_pretrained(base, {str(args.out)!r}) on the exported base model")
    return 0


def _from_peft(args: argparse.Namespace) -> int:
    """``SOURCE OUT --from-peft BASE``: a peft adapter as a megakit LoRA checkpoint on BASE."""
    from megakit.errors import UsageError
    from megakit.interop.peft import import_adapter

    if args.to_hf is not None or args.from_hf or not args.out:
        raise UsageError("give PEFT_DIR OUT_DIR --from-peft BASE_CHECKPOINT, without --to-hf or --from-hf")
    summary = import_adapter(args.source, args.out, base=args.from_peft)
    spec = summary["spec"]
    print(f"wrote {args.out}: a LoRA checkpoint at step 0 ({summary['adapters']} layers) on {args.from_peft}")
    print(
        f"continue training it with: deepspeed scripts/train.py --load {args.out} --lora-rank {spec.rank} "
        f"--lora-alpha {spec.alpha:g} --lora-targets {','.join(spec.targets)}{' --lora-rslora' if spec.rslora else ''}"
    )
    return 0

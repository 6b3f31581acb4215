"""``megakit generate``: a trained checkpoint's continuation of a prompt.

    megakit generate ckpt/step-0000400 --prompt "def fibonacci(n):" --max-new-tokens 80
    megakit generate ckpt --prompt "import os" --temperature 0.8 --seed 1    # the newest intact one of a series

The checkpoint is exported to transformers' layout in a temporary directory (with the
tokenizer it trained with) and run there, so what this prints is what
``transformers.pipeline("text-generation", model=OUT)`` gives after ``megakit convert --to-hf``.
A transformers directory works as CHECKPOINT too.
"""

from __future__ import annotations

import argparse

from megakit.errors import finite_float


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a megakit checkpoint, a --keep series (its newest intact one), or a transformers directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy (the default); above 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: sample from the K likeliest only")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: the sampling seed")


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from megakit.errors import UsageError
    from megakit.interop.hf_generate import generate

    if args.max_new_tokens < 1 or args.temperature < 0:
        raise UsageError("--max-new-tokens must be at least 1 and --temperature at least 0")
    source = Path(args.checkpoint)
    options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
               "seed": args.seed}
    if (source / "config.json").is_file():
        text = generate(source, args.prompt, **options)
    else:
        from megakit.interop.hf_export import export_hf
        from megakit.train.resilience.resume import choose_checkpoint

        checkpoint = choose_checkpoint(str(source), say=lambda *_: None)
        with tempfile.TemporaryDirectory(prefix="megakit-generate-") as tmp:
            export_hf(checkpoint, Path(tmp) / "hf")
            text = generate(Path(tmp) / "hf", args.prompt, **options)
    print(args.prompt + text)
    return 0

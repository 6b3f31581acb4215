"""``megakit generate``: a trained checkpoint's continuation of a prompt.

    megakit generate ckpt/step-0000400 --prompt "def fibonacci(n):" --max-new-tokens 80
    megakit generate ckpt --prompt "import os" --temperature 0.8 --seed 1    # the newest intact one of a series
    megakit generate tuned/ --chat --prompt "What colour is grass?"          # one user turn, the model's template
    megakit generate tuned/ --messages chat.json                             # a conversation: its next reply

The checkpoint is exported to transformers' layout in a temporary directory (with the
tokenizer it trained with) and run there, so what this prints is what
``transformers.pipeline("text-generation", model=OUT)`` gives after ``megakit convert --to-hf``.
A transformers directory works as CHECKPOINT too. With ``--chat`` or ``--messages`` the conversation is
rendered with the model's chat template (its generation prompt added) and the reply, printed alone, ends at the
model's end of turn.
"""

from __future__ import annotations

import argparse

from megakit.errors import finite_float


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds ``megakit generate``'s flags (each command module owns its own, so ``cli`` stays a table)."""
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a megakit checkpoint, a --keep series (its newest intact one), or a transformers directory",
    )
    parser.add_argument("--prompt", help="the text to continue; with --chat, the user's message")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="a chat model: send --prompt as a user turn through the model's chat template and print "
        "its reply, which ends at its end of turn",
    )
    parser.add_argument(
        "--messages",
        metavar="FILE",
        help="a conversation to reply to (implies --chat): a JSON list of {role, content} messages, or "
        "an object with 'messages'; --prompt, if given, is added as a last user turn",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated at most (default 64)")
    parser.add_argument(
        "--temperature", type=finite_float, default=0.0, help="0: greedy (the default); above 0: sampled"
    )
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: sample from the K likeliest only")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: the sampling seed")


def run(args: argparse.Namespace) -> int:
    """Continues a prompt from a checkpoint, to check by eye that a trained or converted model works."""
    import tempfile
    from pathlib import Path

    from megakit.errors import UsageError
    from megakit.interop.hf_generate import generate

    if args.max_new_tokens < 1 or args.temperature < 0:
        raise UsageError("--max-new-tokens must be at least 1 and --temperature at least 0")
    messages = _messages(args)
    if messages is None and args.prompt is None:
        raise UsageError("give --prompt TEXT (with --chat: the user's message) or --messages FILE")
    source = Path(args.checkpoint)
    options = {
        "messages": messages,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
        "source": f"--messages {args.messages}" if args.messages is not None else "--chat --prompt",
    }
    if (source / "config.json").is_file():
        text = generate(source, args.prompt, **options)
    else:
        from megakit.interop.hf_export import export_hf
        from megakit.train.resilience.resume import choose_checkpoint

        checkpoint = choose_checkpoint(str(source), say=lambda *_: None)
        with tempfile.TemporaryDirectory(prefix="megakit-generate-") as tmp:
            export_hf(checkpoint, Path(tmp) / "hf")
            text = generate(Path(tmp) / "hf", args.prompt, **options)
    print(text if messages is not None else args.prompt + text)
    return 0


def _messages(args: argparse.Namespace) -> list[dict] | None:
    """The conversation ``--chat``/``--messages`` ask for (None: plain text to continue)."""
    import json

    from megakit.errors import UsageError

    if args.messages is None:
        if not args.chat:
            return None
        if args.prompt is None:
            raise UsageError("--chat needs --prompt TEXT, the user's message (or give --messages FILE)")
        return [{"role": "user", "content": args.prompt}]
    try:
        value = json.loads(open(args.messages, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--messages {args.messages}: cannot read it as JSON ({error})") from None
    messages = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise UsageError(
            f'--messages {args.messages}: give a JSON list of {{"role": ..., "content": "..."}} '
            "messages, or an object whose 'messages' is one"
        )
    if not messages and args.prompt is None:
        raise UsageError(
            f"--messages {args.messages}: the conversation is empty; give at least one message (or "
            "--prompt TEXT, the user's)"
        )
    return messages + ([{"role": "user", "content": args.prompt}] if args.prompt is not None else [])

"""``megakit prepare-data``: text to token shards the trainer reads with ``--data DIR``.

    megakit prepare-data corpus/ notes.txt --out data/mine --vocab-size 8192
    megakit prepare-data pile.jsonl --field text --tokenizer my-tokenizer/ --out data/pile
    megakit prepare-data chats.jsonl --tokenizer my-model/ --loss-on assistant --out data/chats
    megakit prepare-data train-00000.parquet saved_dataset/ --tokenizer my-model/ --out data/hub
    megakit prepare-data --stdlib --out data/stdlib          # the Python standard library's sources

See ``megakit.interop.prepare_data`` (the pipeline) and ``megakit.interop.token_shards`` (the format).
"""

from __future__ import annotations

import argparse
import os

from megakit.errors import finite_float
from megakit.interop.chat_data import LOSS_ON
from megakit.interop.packing import TOO_LONG


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds ``megakit prepare-data``'s flags (each command module owns its own, so ``cli`` stays a table)."""
    parser.add_argument(
        "inputs",
        metavar="INPUT",
        nargs="*",
        help="text files, directories of them (walked recursively), .jsonl, .parquet and .arrow "
        "files, and datasets.save_to_disk directories",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the data directory to write (replaced atomically)")
    parser.add_argument(
        "--stdlib",
        action="store_true",
        help="add the Python standard library's sources (what the trainer uses by default)",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="train a byte-level BPE of this many tokens")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="use this tokenizer.json or transformers tokenizer directory instead of training one",
    )
    parser.add_argument("--field", default="text", help="the JSONL key (or Parquet column) that holds the text")
    parser.add_argument(
        "--loss-on",
        choices=LOSS_ON,
        default="auto",
        help="chat data (messages, ShareGPT conversations, prompt/completion, Alpaca): the tokens the "
        "loss counts: assistant (each assistant turn: the template's {%% generation %%} blocks, "
        "else found by rendering the conversation turn by turn), completion (after the prompt, or "
        "the last assistant turn), all; auto (the default): assistant for conversations, "
        "completion otherwise. The summary shows one example with the counted tokens in [[ ]]",
    )
    parser.add_argument(
        "--pack",
        type=int,
        metavar="N",
        help="fine-tuning: pack the examples into windows of N tokens (best-fit decreasing; train with "
        "--seq-len N --reset-attention-mask --reset-position-ids, and each trains as alone)",
    )
    parser.add_argument("--pad", type=int, metavar="N", help="fine-tuning: one example per window of N tokens, padded")
    parser.add_argument(
        "--too-long",
        choices=TOO_LONG,
        default="truncate",
        help="with --pack/--pad: an example longer than the window is cut (default) or refused; counted either way",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to render chat data with instead of the tokenizer's own (e.g. one "
        "with {%% generation %%} markers)",
    )
    parser.add_argument(
        "--val-fraction",
        type=finite_float,
        default=0.01,
        help="share of the tokens held out for validation (default 0.01), from the ends of "
        "documents: a document's end once the share owed reaches 1024 tokens (or at the last), "
        "a long document cut in two",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Tokenizes the inputs into training shards once, so a run does not pay for it at every start."""
    from megakit.interop.prepare_data import PrepareConfig, prepare

    inputs = list(args.inputs)
    if args.stdlib:
        from megakit.train.data.batches import stdlib_files

        inputs += [str(p) for p in stdlib_files()]
    cfg = PrepareConfig(
        inputs=inputs,
        out=args.out,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        field=args.field,
        loss_on=args.loss_on,
        chat_template=args.chat_template,
        pack=args.pack,
        pad=args.pad,
        too_long=args.too_long,
        val_fraction=args.val_fraction,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        progress=not args.no_progress,
    )
    s = prepare(cfg)
    if s["unchanged"]:
        print(f"{args.out} is up to date ({s['tokens']['train']:,} train tokens); nothing to do")
        return 0
    if "preference" in s:  # chosen/rejected rows (megakit.interop.preference_data)
        c, window = s["preference"], args.pack or args.pad
        print(
            f"wrote {args.out}: {c['pairs']:,} preference pairs ({c['identical']:,} with chosen = rejected skipped, "
            f"{c['truncated']:,} cut to fit) in {s['tokens']['train'] // window:,} train windows of {window} tokens; "
            f"train with --objective dpo --seq-len {window} --reset-attention-mask --reset-position-ids"
        )
        return 0
    rate = s["bytes"] / 2**20 / s["seconds"]
    bad = f", {s['bad_records']:,} bad records skipped" if s.get("bad_records") else ""
    bad += f", {s['empty_records']:,} empty records skipped" if s.get("empty_records") else ""
    print(
        f"wrote {args.out}: {s['tokens']['train']:,} train and {s['tokens']['validation']:,} validation tokens "
        f"from {s['input_documents']:,} documents ({s['cut_documents']:,} cut between the two) in "
        f"{s['files'] - s['skipped']} "
        f"files ({s['skipped']} skipped{bad}), vocabulary {s['vocab_size']}, {s['seconds']:.1f} s, {rate:.2f} MB/s"
    )
    if s.get("packed"):
        p = s["packed"]
        print(
            f"{'packed' if args.pack else 'padded'} {p['examples']:,} examples into {p['bins']:,} windows of "
            f"{p['window']} tokens ({p['fill']:.0%} filled, {p['truncated']:,} cut to fit); train with --seq-len "
            f"{p['window']} --reset-attention-mask --reset-position-ids"
        )
    if s.get("chat"):
        train, loss = s["tokens"]["train"], s["loss_tokens"]["train"]
        print(
            f"loss on {s['loss_on']}: {loss:,} of the {train:,} train tokens ({loss / max(train, 1):.0%}) count in "
            "the loss, the rest is context"
        )
        if s.get("example"):  # cut at chat_data.EXAMPLE_CHARS
            print(f"the first example, the tokens the loss counts in [[ ]]:\n{s['example']}")
    print(f"train on it with: deepspeed scripts/train.py --data {args.out} ...")
    return 0

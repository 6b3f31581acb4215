"""Preference pairs for DPO, IPO and SimPO (``prepare-data`` on rows with ``chosen`` and ``rejected``), in TRL's
shapes: standard (``prompt``, ``chosen``, ``rejected`` strings), conversational (``prompt`` messages, ``chosen`` and
``rejected`` assistant messages, rendered with the chat template: the completion is what the whole conversation
adds to the prompt rendered with its generation prompt, as TRL renders it) and implicit prompt (two whole
conversations or texts: the prompt is their shared prefix, TRL's ``extract_prompt``).

Each pair becomes two sequences, prompt + chosen and prompt + rejected, each ending with end-of-text, the loss mask on
the completion. A pair is one unit of packing: ``--pack N`` lays pairs into windows of N tokens by best-fit
decreasing, ``--pad N`` one pair a window; the two sequences sit side by side, chosen first, each its own document
(the trainer's objective reads the pairs from the documents in order, ``megakit.nn.tensor_parallel.preference``).
So a pair is never split over windows, and so never over micro-batches or DP ranks. A pair longer than the window
is cut (its completions shortened alike, ``--too-long truncate``) or refused, counted; a prompt that leaves no
room for a completion is an error. ``chosen`` equal to ``rejected`` teaches nothing: counted and skipped. A row
missing either is an error naming it. Rows are read in one process (tokenizing is cheap next to training on them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megakit.errors import UsageError
from megakit.interop import columnar, packing
from megakit.interop import tokenizer as tok


def is_preference(record: dict) -> bool:
    """A TRL preference row: it names ``chosen`` or ``rejected``."""
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def _shared_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def split_pair(record: dict, where: str) -> tuple:
    """``(prompt, chosen, rejected)``: strings, or message lists (conversational), the prompt made explicit."""
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise UsageError(f"{where}: a preference row needs 'chosen' and 'rejected'; it has no {missing[0]!r}")
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt")
    if prompt is None:  # implicit prompt: the longest shared prefix (whole messages for conversations)
        n = _shared_prefix(chosen, rejected)
        if isinstance(chosen, list):
            while n and chosen[n - 1].get("role") == "assistant":  # the prompt ends before an assistant turn
                n -= 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    kinds = {type(x) for x in (prompt, chosen, rejected)}
    if kinds not in ({str}, {list}):
        raise UsageError(
            f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all be lists of messages (TRL's "
            "standard or conversational shape)"
        )
    return prompt, chosen, rejected


class PairEncoder:
    """Token ids and loss mask of each sequence of a pair, with one tokenizer (and template for conversations)."""

    def __init__(self, tokenizer, template: str | None, specials: dict, *, eos: int | None) -> None:
        self.tokenizer, self.template, self.specials, self.eos = tokenizer, template, specials, eos
        self._fast = None

    def _render(self, messages, generation_prompt: bool) -> str:
        if self.template is None:
            raise UsageError(
                "conversational pairs are rendered with a chat template, and the tokenizer has none; pass "
                "--chat-template FILE"
            )
        if self._fast is None:
            from transformers import PreTrainedTokenizerFast

            self._fast = PreTrainedTokenizerFast(
                tokenizer_object=self.tokenizer, chat_template=self.template, **self.specials
            )
        return self._fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, prompt, completions) -> tuple[list[int], list[list[int]]]:
        """The prompt's ids and each completion's (each ends with end-of-text, as TRL appends eos)."""
        if isinstance(prompt, list):
            head = self._render(prompt, True)
            texts = []
            for c in completions:
                whole = self._render(prompt + c, False)
                texts.append(
                    whole[len(head) :] if whole.startswith(head) else whole[len(self._render(prompt, False)) :]
                )
            prompt = head
        else:
            texts = completions
        end = [] if self.eos is None else [self.eos]
        return self._ids(prompt), [self._ids(t) + end for t in texts]


def pair_sequences(prompt: list[int], completions: list[list[int]], window: int, too_long: str, where: str):
    """``[(ids, mask), (ids, mask)]``: prompt + chosen, prompt + rejected, cut alike to fit ``window`` together."""
    room = window - 2 * len(prompt)
    if room < 2:
        raise UsageError(
            f"{where}: the prompt has {len(prompt)} tokens, and a pair (twice the prompt, and the completions) "
            f"needs more than the --pack/--pad window of {window}; raise the window or shorten the prompt"
        )
    total = sum(len(c) for c in completions)
    truncated = total > room
    if truncated:
        if too_long == "refuse":
            raise UsageError(
                f"{where}: a pair of {2 * len(prompt) + total} tokens does not fit the --pack/--pad window of "
                f"{window}; raise the window, or pass --too-long truncate to cut such pairs (counted)"
            )
        keep = room // 2
        a, b = (min(len(c), keep) for c in completions)
        a, b = min(len(completions[0]), room - b), min(len(completions[1]), room - a)  # one short: the other longer
        completions = [completions[0][:a], completions[1][:b]]
    out = []
    for c in completions:
        ids = np.asarray(prompt + c, dtype=np.int64)
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(c), np.uint8)])
        out.append((ids, mask))
    return out, truncated


def pair_bins(pairs: list, window: int, *, pack: bool, pad_id: int):
    """``(ids, mask, document starts)`` of each window: whole pairs, chosen then rejected, then padding."""
    sizes = [len(a[0]) + len(b[0]) for a, b in pairs]
    groups = packing.best_fit_decreasing(sizes, window) if pack else [[i] for i in range(len(pairs))]
    for group in sorted(groups, key=min):
        parts = [seq for i in sorted(group) for seq in pairs[i]]
        used = sum(len(ids) for ids, _ in parts)
        ids = np.concatenate([p[0] for p in parts] + [np.full(window - used, pad_id, dtype=np.int64)])
        mask = np.concatenate([p[1] for p in parts] + [np.zeros(window - used, dtype=np.uint8)])
        starts = np.cumsum([0] + [len(p[0]) for p in parts])[: len(parts) + (used < window)]
        mask[starts] = 0  # a sequence's first token is predicted by nothing of its own
        yield ids, mask, starts


def read_rows(files: list[Path]):
    """``(record, where)`` of every JSONL line and Parquet/Arrow row, in order; a malformed one is an error."""
    for path in files:
        if columnar.is_columnar(path):
            from megakit.interop.prepare_data import pieces

            for _, start, end, _ in pieces(path):
                for record, where in columnar.records(path, start, end):
                    yield record, where
            continue
        with open(path, "rb") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    raise UsageError(f"{path}: line {n} is not a JSON object; fix or remove it") from None
                yield record, f"{path}: line {n}"


def encode_pairs(rows, encoder: PairEncoder, window: int, too_long: str) -> tuple[list, dict]:
    """Every row's two sequences, and the counts: pairs, skipped (chosen equal to rejected), truncated."""
    pairs, counts = [], {"pairs": 0, "identical": 0, "truncated": 0}
    for record, where in rows:
        if not isinstance(record, dict):
            raise UsageError(f"{where}: a preference row must be an object with 'chosen' and 'rejected'")
        prompt, chosen, rejected = split_pair(record, where)
        if chosen == rejected:
            counts["identical"] += 1
            continue
        prompt_ids, completions = encoder.encode(prompt, [chosen, rejected])
        if completions[0] == completions[1]:
            counts["identical"] += 1
            continue
        seqs, truncated = pair_sequences(prompt_ids, completions, window, too_long, where)
        pairs.append(seqs)
        counts["pairs"] += 1
        counts["truncated"] += truncated
    if not pairs:
        raise UsageError("the inputs hold no preference pair to train on (every chosen equals its rejected)")
    return pairs, counts


def write_pairs(cfg, files: list[Path], tmp: Path, stamp: str, say) -> dict:
    """``prepare-data`` for preference rows: the pairs in windows, a validation split of whole pairs, the index."""
    from megakit.interop.prepare_data import chat_template
    from megakit.interop.token_shards import ShardWriter, token_dtype, write_index

    if not cfg.tokenizer:
        raise UsageError("preference pairs are tokenized with the model's own tokenizer: pass --tokenizer DIR")
    if cfg.window is None:
        raise UsageError("preference pairs train in windows that hold whole pairs: pass --pack N or --pad N")
    tokenizer = tok.load_tokenizer(cfg.tokenizer)
    vocab, eos = tok.vocab_size(tokenizer), tok.end_of_text_id(tokenizer)
    encoder = PairEncoder(tokenizer, chat_template(cfg), tok.special_tokens(cfg.tokenizer), eos=eos)
    pairs, counts = encode_pairs(read_rows(files), encoder, cfg.window, cfg.too_long)
    dtype, window, f = token_dtype(vocab), cfg.window, cfg.val_fraction
    held = [int((i + 1) * f) > int(i * f) for i in range(len(pairs))]
    tokens, slots, splits = {}, 2, {}
    for name in ("train", "validation"):
        writer = ShardWriter(tmp, name, dtype, shard_tokens=1 << 62, masks=True)
        mine = [p for p, h in zip(pairs, held) if h == (name == "validation")]
        tokens[name] = 0
        for ids, mask, starts in pair_bins(mine, window, pack=bool(cfg.pack), pad_id=eos if eos is not None else 0):
            for a, b in zip(starts, [*starts[1:], window]):
                writer.add(ids[a:b].astype(dtype), mask[a:b])
            slots, tokens[name] = max(slots, len(starts)), tokens[name] + window
        if mine:
            writer.add(np.full(1, eos or 0, dtype=dtype), np.zeros(1, dtype=np.uint8))  # the last window's label
        splits[name] = writer.close()
    tok.save_tokenizer(
        tokenizer, tmp, source=cfg.tokenizer, chat_template=encoder.template if cfg.chat_template else None
    )
    if counts["identical"]:
        say(
            f"prepare-data: skipped {counts['identical']:,} pairs whose chosen equals their rejected (nothing to learn)"
        )
    if counts["truncated"]:
        say(f"prepare-data: cut {counts['truncated']:,} pairs longer than the window of {window} (--too-long truncate)")
    summary = {"files": len(files), "vocab_size": vocab, "tokens": tokens, "preference": counts, "chat": False}
    strategy = "bfd" if cfg.pack else "pad"
    write_index(
        tmp,
        {
            "dtype": dtype.name,
            "vocab_size": vocab,
            "eos_id": eos,
            "packed": {"seq_len": window, "strategy": strategy, "pairs": slots + slots % 2},
            "source": {"fingerprint": stamp, "inputs": [str(i) for i in cfg.inputs], "skipped": []},
            "splits": splits,
            "summary": summary,
        },
    )
    return summary

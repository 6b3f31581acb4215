"""The parallel tokenizing: a pool of processes (forked from a clean fork server), each with its own copy of the
tokenizer, that read their pieces of the inputs and return each document's ids (and a chat record's loss mask)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np

from megakit.interop import chat_data as chat
from megakit.interop.prepare_data.inputs import read_documents

_WORKER: dict = {}


def init_worker(
    tokenizer_json: str, text_field: str | None, eos: int | None, dtype: str, chat_args: tuple | None = None
) -> None:
    """Set up this worker (or this process, with one worker): its own tokenizer and, for chat data, renderer."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    renderer = chat.ChatRenderer(tokenizer, *chat_args, eos=eos) if chat_args else None
    _WORKER.update(tokenizer=tokenizer, field=text_field, eos=eos, dtype=np.dtype(dtype), chat=renderer)


def _encode_chat(task) -> list[tuple[list, int, str | None, tuple]]:
    """``encode_pieces`` for chat data: each record's ids and loss mask; a record that renders to nothing to
    train on (no assistant turn, a malformed message) is counted with the bad lines."""
    renderer, dtype, out = _WORKER["chat"], _WORKER["dtype"], []
    for path, start, end, size in task:
        records, skipped, (bad, first, empty) = read_documents(Path(path), None, start, end)
        arrays = []
        for (_, where), rendered in zip(records, renderer.many(records)):
            if isinstance(rendered, ValueError):
                bad, first = bad + 1, first or f"{where} ({rendered})"
                continue
            ids, mask = rendered
            arrays.append((np.array(ids, dtype=dtype), np.array(mask, dtype=np.uint8)))
        out.append((arrays, size, skipped, (bad, first, empty)))
    return out


def encode_pieces(
    task: list[tuple[str, int, int | None, int]],
) -> list[tuple[list[np.ndarray], int, str | None, tuple]]:
    """Per piece: its documents' ids (end-of-text appended), its size in bytes, why its file was skipped (or
    None), its bad and empty records (``read_documents``)."""
    if _WORKER["chat"] is not None:
        return _encode_chat(task)
    tokenizer, eos, dtype = _WORKER["tokenizer"], _WORKER["eos"], _WORKER["dtype"]
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets computed
    read = [read_documents(Path(path), _WORKER["field"], start, end) for path, start, end, _ in task]
    texts = [doc for docs, _, _ in read for doc in docs]
    encoded = iter(encode(texts, add_special_tokens=False)) if texts else iter(())
    tail = [] if eos is None else [eos]
    out = []
    for (_, _, _, size), (docs, skipped, bad) in zip(task, read):
        arrays = [np.array(next(encoded).ids + tail, dtype=dtype) for _ in docs]
        out.append((arrays, size, skipped, bad))
    return out


def worker_context():
    """Workers forked from a fork server, a fresh interpreter that has imported this module and nothing else.
    Forked from this process instead, they would inherit its heap (after training a tokenizer, or anything a
    caller did before), and every page a worker writes would first be copied: measured, 10-30 % more CPU."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context

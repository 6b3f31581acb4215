"""Deciding between text and chat data, and what a chat corpus is rendered with: the template (``--chat-template``
or the tokenizer's own), ``--loss-on`` and the special tokens. The rendering itself is ``megakit.interop.chat_data``'s,
run by the workers."""

from __future__ import annotations

import json
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop import chat_data, columnar
from megakit.interop import tokenizer as tok
from megakit.interop.prepare_data.config import PrepareConfig
from megakit.interop.prepare_data.inputs import pieces


def first_record(files: list[Path]) -> dict | None:
    """The first record of the first JSONL, Parquet or Arrow file (what decides between text and chat data), or None."""
    for path in files:
        if columnar.is_columnar(path):
            for _, start, end, _ in pieces(path):
                try:
                    rows = columnar.records(path, start, end)
                except Exception:  # noqa: BLE001 - skipped with the reason when read
                    break
                if rows:
                    return rows[0][0]
            continue
        if path.suffix != ".jsonl":
            continue
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                if isinstance(record, dict):
                    return record
    return None


def chat_template(cfg: PrepareConfig) -> str | None:
    """``--chat-template FILE``, else the template of the ``--tokenizer`` directory (its config or its .jinja file)."""
    if cfg.chat_template:
        try:
            return Path(cfg.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --chat-template {cfg.chat_template}: {error}; give a Jinja file") from None
    source = Path(cfg.tokenizer) if cfg.tokenizer else None
    if source is None or not source.is_dir():
        return None
    if (source / "chat_template.jinja").is_file():
        return (source / "chat_template.jinja").read_text()
    try:
        template = json.loads((source / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    return template if isinstance(template, str) else None


def chat_args(cfg: PrepareConfig, files: list[Path]) -> tuple | None:
    """``(template, loss_on, special tokens, the template's source)`` for chat data (None for text)."""
    record = first_record(files)
    if record is None or not chat_data.is_chat(record):
        return None
    if not cfg.tokenizer:
        raise UsageError(
            "chat and instruction data is tokenized with the model's own tokenizer: pass --tokenizer DIR "
            "(a transformers tokenizer directory, with its chat template)"
        )
    template = chat_template(cfg)
    if template is None and ("messages" in record or "conversations" in record):
        raise UsageError(
            f"conversations are rendered with a chat template, and --tokenizer {cfg.tokenizer} has none; "
            "pass --chat-template FILE (a Jinja template)"
        )
    source = (
        f"--chat-template {cfg.chat_template}"
        if cfg.chat_template
        else f"the chat template of --tokenizer {cfg.tokenizer}"
    )
    return template, cfg.loss_on, tok.special_tokens(cfg.tokenizer), source

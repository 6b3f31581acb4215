"""``prepare-data``'s settings, validated on construction so that a bad flag is one line before any file is read."""

from __future__ import annotations

from dataclasses import dataclass

from megakit.errors import UsageError
from megakit.interop import chat_data as chat
from megakit.interop import packing


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What ``prepare-data`` is asked: inputs, output, tokenizer, split, workers, chat and packing settings."""

    inputs: list[str]
    out: str
    vocab_size: int = 4096
    tokenizer: str | None = None  # a tokenizer.json / transformers directory instead of training one
    field: str = "text"  # the JSONL key holding the text
    val_fraction: float = 0.01
    workers: int = 1
    shard_tokens: int = 1 << 26
    max_train_bytes: int = 1 << 28  # text the BPE is trained on (the first files, in order)
    loss_on: str = "auto"  # chat data: which tokens the loss counts (chat_data.LOSS_ON)
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's own template
    pack: int | None = None  # examples packed into windows of this many tokens (best-fit decreasing; packing.py)
    pad: int | None = None  # one example per window of this many tokens, padded
    too_long: str = "truncate"  # an example longer than the window: truncate | refuse
    progress: bool = True

    def __post_init__(self) -> None:
        if self.pack is not None and self.pad is not None:
            raise UsageError("give one of --pack N (several examples per window) and --pad N (one, padded)")
        if self.window is not None and self.window < 2:
            raise UsageError(f"--pack/--pad {self.window}: a window needs at least 2 tokens, e.g. 2048")
        if self.too_long not in packing.TOO_LONG:
            raise UsageError(f"--too-long {self.too_long} is not one of {', '.join(packing.TOO_LONG)}")
        if self.loss_on not in chat.LOSS_ON:
            raise UsageError(f"--loss-on {self.loss_on} is not one of {', '.join(chat.LOSS_ON)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.workers < 1 or self.shard_tokens < 1:
            raise UsageError("--workers and --shard-tokens must be at least 1")

    @property
    def window(self) -> int | None:
        """The tokens of a window that --pack or --pad fills (None: the documents stream as they are)."""
        return self.pack if self.pack is not None else self.pad

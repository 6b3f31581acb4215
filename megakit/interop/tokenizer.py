"""The tokenizer a data directory is cut with: trained offline on the user's text, or a local one.

Why Hugging Face ``tokenizers``: its byte-level BPE trains in seconds on a laptop, needs
nothing from the network, and what it saves (``tokenizer.json``) is what
``transformers.AutoTokenizer`` loads, so the tokenizer travels from ``prepare-data`` through
the checkpoint to ``convert --to-hf`` unchanged. Training is deterministic: the same text
gives the same merges (a test trains twice and compares).

Documents are separated by an end-of-text token (``<|endoftext|>`` for a trained one, the
tokenizer's own for a loaded one); ``add_special_tokens=False`` everywhere, so the ids of a
document are exactly ``tokenizer.encode(text).ids`` and nothing else is inserted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from megakit.errors import UsageError

END_OF_TEXT = "<|endoftext|>"
_EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MIN_VOCAB = 256 + 1  # the 256 byte symbols and the end-of-text token


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (end-of-text included) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise UsageError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB} "
                         "(256 bytes and the end-of-text token); 4096 or more is usual")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: str | Path):
    """A local ``tokenizer.json``, or a directory holding one (a transformers tokenizer directory), as a
    ``tokenizers.Tokenizer``; UsageError if it is neither. Nothing is downloaded."""
    from tokenizers import Tokenizer

    source = Path(path)
    file = source / "tokenizer.json" if source.is_dir() else source
    if not source.exists():
        raise UsageError(f"--tokenizer {source}: no such file or directory; give a tokenizer.json or a transformers "
                         "tokenizer directory")
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as error:  # noqa: BLE001 (tokenizers raises a plain Exception on a bad file)
            raise UsageError(f"--tokenizer {file} is not a tokenizers JSON file ({str(error)[:120]}); give the "
                             "tokenizer.json a fast tokenizer saves") from None
    try:  # a transformers directory without tokenizer.json: its fast tokenizer, converted locally
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source), local_files_only=True, use_fast=True).backend_tokenizer
    except Exception as error:  # noqa: BLE001 (transformers raises many kinds for a directory it cannot read)
        raise UsageError(f"--tokenizer {source} holds no tokenizer.json and transformers cannot load a fast tokenizer "
                         f"from it ({str(error)[:120]})") from None


def end_of_text_id(tokenizer) -> int | None:
    """The id that ends each document: the first known end-of-text token the vocabulary has, else None."""
    for name in _EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def vocab_size(tokenizer) -> int:
    """Rows the model's embedding needs: one past the largest id (added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def save_tokenizer(tokenizer, directory: str | Path, *, model_max_length: int | None = None) -> list[str]:
    """Write ``tokenizer`` as transformers saves a fast tokenizer (``AutoTokenizer.from_pretrained(directory)``
    loads it); returns the file names written."""
    from transformers import PreTrainedTokenizerFast

    eos = end_of_text_id(tokenizer)
    eos_token = None if eos is None else tokenizer.id_to_token(eos)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, bos_token=eos_token,
                                      unk_token=eos_token, model_max_length=model_max_length or int(1e30))
    return [Path(f).name for f in wrapped.save_pretrained(str(directory)) if Path(f).is_file()]


def copy_tokenizer(source: str | Path, target: str | Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a directory ``save_tokenizer`` wrote) into ``target``."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def export_tokenizer(source: str | Path, target: str | Path, *, model_max_length: int) -> int | None:
    """Copy a saved tokenizer next to exported weights, with the model's context as ``model_max_length``;
    returns its end-of-text id (which the exported config names as ``eos_token_id``)."""
    from tokenizers import Tokenizer

    copy_tokenizer(source, target)
    config_file = Path(target) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        config["model_max_length"] = model_max_length
        config_file.write_text(json.dumps(config, indent=2))
    return end_of_text_id(Tokenizer.from_file(str(Path(source) / "tokenizer.json")))

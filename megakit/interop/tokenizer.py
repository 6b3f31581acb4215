"""The tokenizer a data directory is cut with: trained offline on the user's text, or a local one.

Why Hugging Face ``tokenizers``: its byte-level BPE trains in seconds on a laptop, needs
nothing from the network, and what it saves (``tokenizer.json``) is what
``transformers.AutoTokenizer`` loads, so the tokenizer travels from ``prepare-data`` through
the checkpoint to ``convert --to-hf`` unchanged. Training is deterministic: the same text
gives the same merges (a test trains twice and compares).

Documents are separated by an end-of-text token (``<|endoftext|>`` for a trained one, the
tokenizer's own for a loaded one); ``add_special_tokens=False`` everywhere, so the ids of a
document are exactly ``tokenizer.encode(text).ids`` and nothing else is inserted.

A transformers tokenizer directory (a chat model's) travels whole: its ``tokenizer_config.json`` (special
tokens: a ChatML model's eos is ``<|im_end|>``, not the end-of-text that separates documents), its chat
template and its model's ``generation_config.json`` (the ids generation stops at: eos, maybe several; pad; bos)
are copied as they are into the data directory, each checkpoint and the export, where they set config.json's
``eos_token_id`` and ``bos_token_id``. A model directory without ``generation_config.json`` gets the one
transformers would derive from its config.json.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from megakit.errors import UsageError

END_OF_TEXT = "<|endoftext|>"
_EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# a slow tokenizer's vocabulary (SentencePiece, GPT-2 BPE, WordPiece): what transformers converts to a fast one
SLOW_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
GENERATION_CONFIG = "generation_config.json"  # the model's stop ids, travelling with its tokenizer
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_STOP_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
MIN_VOCAB = 256 + 1  # the 256 byte symbols and the end-of-text token


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (end-of-text included) trained on
    ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise UsageError(
            f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB} "
            "(256 bytes and the end-of-text token); 4096 or more is usual"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def has_vocabulary(directory: str | Path) -> bool:
    """Whether a directory holds a tokenizer's vocabulary (``tokenizer.json`` or a slow tokenizer's files): with only
    ``tokenizer_config.json``, transformers 5 builds a tokenizer of a few special tokens from nothing."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer.json", *SLOW_FILES))


def load_tokenizer(path: str | Path, *, flag: str = "--tokenizer"):
    """A local ``tokenizer.json``, or a directory holding one (a transformers tokenizer directory), as a
    ``tokenizers.Tokenizer``; UsageError if it is neither. Nothing is downloaded. ``flag``: what gave ``path``, named
    in the errors ("" where it is a command's positional argument)."""
    from tokenizers import Tokenizer

    source = Path(path)
    named = f"{flag} " if flag else ""
    file = source / "tokenizer.json" if source.is_dir() else source
    if not source.exists():
        raise UsageError(
            f"{named}{source}: no such file or directory; give a tokenizer.json or a transformers tokenizer directory"
        )
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as error:  # noqa: BLE001 (tokenizers raises a plain Exception on a bad file)
            raise UsageError(
                f"{named}{file} is not a tokenizers JSON file ({str(error)[:120]}); give the "
                "tokenizer.json a fast tokenizer saves"
            ) from None
    if not has_vocabulary(source):
        raise UsageError(
            f"{named}{source} holds no tokenizer.json nor a slow tokenizer's vocabulary "
            f"({', '.join(SLOW_FILES)}); give the directory the model's tokenizer was saved to"
        )
    try:  # a transformers directory without tokenizer.json: its fast tokenizer, converted locally
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source), local_files_only=True, use_fast=True).backend_tokenizer
    except Exception as error:  # noqa: BLE001 (transformers raises many kinds for a directory it cannot read)
        raise UsageError(
            f"{named}{source} holds no tokenizer.json and transformers cannot load a fast tokenizer "
            f"from it ({str(error)[:120]})"
        ) from None


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


def special_tokens(source: str | Path | None) -> dict[str, str]:
    """The special tokens (``SPECIAL_TOKENS``) a transformers tokenizer directory declares, as strings, read from
    its files as transformers reads them (``tokenizer_config.json`` over the older ``special_tokens_map.json``;
    a token is a string or an ``AddedToken`` dict); ``{}`` for a ``tokenizer.json`` alone (or None). Chat templates
    read them (``{{ bos_token }}``)."""
    found: dict[str, str] = {}
    if source is None or not Path(source).is_dir():
        return found
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            declared = json.loads((Path(source) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for key in SPECIAL_TOKENS:
            value = declared.get(key, found.get(key))
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
            else:
                found.pop(key, None)
    return found


def _generation_config(source: Path) -> dict | None:
    """The model's ``generation_config.json``, else the stop ids of its ``config.json`` (what transformers derives
    the generation config from), else None."""
    for name, keys in ((GENERATION_CONFIG, None), ("config.json", _STOP_IDS)):
        try:
            config = json.loads((source / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        picked = config if keys is None else {k: config[k] for k in keys if config.get(k) is not None}
        if picked:
            return picked
    return None


def as_ids(value) -> list:
    """A config's token id field (an id, a list of them, or None) as a list (whatever else it holds, as one item)."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_eos_ids(stops, rows: int, *, source: str, vocabulary: str, fix: str) -> None:
    """UsageError, in one line, where an eos id (``stops``: a config's id, list of ids, or None) is not an id below
    ``rows`` (``vocabulary`` names them: the tokenizer's or the model's): generation could never stop."""
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < rows for i in as_ids(stops)):
        raise UsageError(
            f"{source}: its eos_token_id {stops} is not in {vocabulary} of {rows}, so generation could "
            f"never stop; {fix}"
        )


def check_stop_tokens(tokenizer, directory: str | Path, *, source: str) -> None:
    """UsageError, in one line, for a tokenizer whose eos (or an eos id of its model's generation config) is not in
    its vocabulary: generation would never stop. (A bos or pad id is left alone: some configs hold -1.)"""
    specials = special_tokens(directory)
    eos = specials.get("eos_token")
    if eos is not None and tokenizer.token_to_id(eos) is None:
        raise UsageError(
            f"{source}: the eos token {eos!r} is not in the tokenizer's vocabulary, so generation "
            "could never stop; fix eos_token in its tokenizer_config.json (or add the token)"
        )
    check_eos_ids(
        (_generation_config(Path(directory)) or {}).get("eos_token_id"),
        vocab_size(tokenizer),
        source=source,
        vocabulary="the tokenizer's vocabulary",
        fix="fix the model's generation_config.json (or config.json)",
    )


def check_model_stop_ids(hf_dir: str | Path) -> None:
    """UsageError, in one line, for a transformers model whose eos ids (generation config, else config.json) are not
    rows of its embedding: generation could never stop."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # the import names what is wrong with it
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if rows:
        check_eos_ids(
            (_generation_config(Path(hf_dir)) or {}).get("eos_token_id"),
            rows,
            source=str(hf_dir),
            vocabulary="the model's vocabulary",
            fix="fix generation_config.json (or config.json)",
        )


def model_tokenizer(hf_dir: str | Path, *, say=print):
    """A transformers model directory's tokenizer (None if it has no vocabulary: ``say`` tells why, where it has a
    ``tokenizer_config.json``), loaded before an import writes anything; ``save_tokenizer(it, CHECKPOINT/tokenizer,
    source=hf_dir)`` then carries it with its template and stop ids, as ``prepare-data`` does, so the import exports
    and chats before any training."""
    hf_dir = Path(hf_dir)
    if not has_vocabulary(hf_dir):
        if (hf_dir / "tokenizer_config.json").is_file():
            say(
                f"note: {hf_dir} has a tokenizer_config.json but no tokenizer.json nor a slow tokenizer's vocabulary "
                f"({', '.join(SLOW_FILES)}), so it is imported without a tokenizer; prepare the data with "
                "--tokenizer DIR, the model's tokenizer, and the checkpoints carry it"
            )
        return None
    return load_tokenizer(hf_dir, flag="")


def save_tokenizer(
    tokenizer,
    directory: str | Path,
    *,
    model_max_length: int | None = None,
    source: str | Path | None = None,
    chat_template: str | None = None,
) -> list[str]:
    """Write ``tokenizer`` as transformers saves a fast tokenizer (``AutoTokenizer.from_pretrained(directory)``
    loads it); returns the file names written. ``source``, a transformers directory: its files as they are (special
    tokens, template, added tokens) and its model's generation config; else (a tokenizer trained here, or a
    ``tokenizer.json`` alone) the end-of-text token is eos. ``chat_template``: replaces the source's template."""
    directory = Path(directory)
    if source is not None and (Path(source) / "tokenizer_config.json").is_file():
        source = Path(source)
        written = copy_tokenizer(source, directory)
        if "tokenizer.json" not in written:  # a directory of slow-tokenizer files: its fast form, converted
            tokenizer.save(str(directory / "tokenizer.json"))
            written.append("tokenizer.json")
        generation = _generation_config(source)
        if generation is not None and GENERATION_CONFIG not in written:  # derived from its config.json
            (directory / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
            written.append(GENERATION_CONFIG)
        if chat_template is not None:
            (directory / "chat_template.jinja").write_text(chat_template)
            config = json.loads((directory / "tokenizer_config.json").read_text())
            config.pop("chat_template", None)  # one template, the file's
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
            written.append("chat_template.jinja")
        return sorted(set(written))
    from transformers import PreTrainedTokenizerFast

    eos = end_of_text_id(tokenizer)
    eos_token = None if eos is None else tokenizer.id_to_token(eos)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        bos_token=eos_token,
        unk_token=eos_token,
        model_max_length=model_max_length or int(1e30),
        chat_template=chat_template,
    )
    return [Path(f).name for f in wrapped.save_pretrained(str(directory)) if Path(f).is_file()]


def copy_tokenizer(source: str | Path, target: str | Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a directory ``save_tokenizer`` wrote, or a transformers one) and its
    generation config into ``target``."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in (*FILES, GENERATION_CONFIG):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def export_tokenizer(source: str | Path, target: str | Path, *, model_max_length: int) -> dict:
    """Copy a saved tokenizer next to exported weights, with the model's context as ``model_max_length``; returns
    the ids generation stops at (``bos_token_id``, ``eos_token_id``, ``pad_token_id``; None where there is none):
    the model's generation config where it travelled with the tokenizer, else the tokenizer's special tokens, else
    its end-of-text token as eos and bos (a tokenizer trained here)."""
    from tokenizers import Tokenizer

    copy_tokenizer(source, target)
    config_file = Path(target) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        config["model_max_length"] = model_max_length
        config_file.write_text(json.dumps(config, indent=2))
    generation = _generation_config(Path(source))
    if generation is not None and generation.get("eos_token_id") is not None:
        return {key: generation.get(key) for key in _STOP_IDS}
    tokenizer = Tokenizer.from_file(str(Path(source) / "tokenizer.json"))
    specials = special_tokens(source)
    if "eos_token" in specials:
        return {
            f"{key}_id": tokenizer.token_to_id(specials[key]) if key in specials else None
            for key in ("bos_token", "eos_token", "pad_token")
        }
    eos = end_of_text_id(tokenizer)
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}

"""Continue a prompt, or answer a conversation, with an exported model, through transformers: what a user of the
model would run.

A model trained on bytes (no tokenizer in the export) is fed the prompt's UTF-8 bytes as ids
and its output decoded the same way, so the default byte-level run can be talked to too.
A conversation (``messages``) is rendered with the model's chat template and its generation prompt, and the
reply ends at the model's stop ids (``generation_config.json``: a chat model's end of turn), as
``apply_chat_template`` + ``generate`` does.
"""

from __future__ import annotations

from pathlib import Path

from megakit.errors import UsageError


def generate(
    hf_dir: str | Path,
    prompt: str | None,
    *,
    messages: list[dict] | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    source: str = "the conversation",
) -> str:
    """The prompt's continuation (the prompt not included), or with ``messages`` the assistant's reply; greedy at
    ``temperature`` 0. ``source``: where ``messages`` came from, named when the chat template refuses them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = Path(hf_dir)
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    if messages is not None:
        if tokenizer is None or not tokenizer.chat_template:
            raise UsageError(
                "the model has no chat template (its tokenizer, from the data it was trained on, has "
                "none); drop --chat/--messages and give --prompt text to continue"
            )
        from jinja2 import TemplateError

        try:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
            )["input_ids"]
        except (ValueError, TemplateError) as error:  # an empty conversation; the template's raise_exception
            why = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UsageError(
                f"{source}: the model's chat template cannot render it ({why}); give the conversation "
                "it expects (e.g. roles that alternate user/assistant)"
            ) from None
    elif tokenizer is not None:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k or None}
        if temperature > 0
        else {"do_sample": False}
    )
    torch.manual_seed(seed)
    eos = None  # a byte-level model never stops early
    if tokenizer is not None:  # the model's stop ids (several for a chat model), else its tokenizer's eos
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
    first = eos[0] if isinstance(eos, list) and eos else eos
    pad = model.generation_config.pad_token_id if tokenizer is not None else None
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad if pad is not None else first if first is not None else 0,
            **sampling,
        )
    new = out[0, ids.shape[1] :].tolist()
    if tokenizer is not None:
        return tokenizer.decode(new, skip_special_tokens=True)
    return bytes(i for i in new if i < 256).decode("utf-8", errors="replace")

"""Continue a prompt with an exported model, through transformers: what a user of the model would run.

A model trained on bytes (no tokenizer in the export) is fed the prompt's UTF-8 bytes as ids
and its output decoded the same way, so the default byte-level run can be talked to too.
"""

from __future__ import annotations

from pathlib import Path


def generate(hf_dir: str | Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0) -> str:
    """The prompt's continuation (the prompt not included); greedy at ``temperature`` 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = Path(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k or None} if temperature > 0 else {
        "do_sample": False}
    torch.manual_seed(seed)
    eos = model.config.eos_token_id if tokenizer is not None else None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos if eos is not None else 0, **sampling)
    new = out[0, ids.shape[1]:].tolist()
    if tokenizer is not None:
        return tokenizer.decode(new, skip_special_tokens=True)
    return bytes(i for i in new if i < 256).decode("utf-8", errors="replace")

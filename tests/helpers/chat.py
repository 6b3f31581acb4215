"""Chat data shared by the chat, packing, SFT and docs tests: conversations, ChatML templates, a tiny tokenizer
and a released chat model written locally."""

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# As released templates write them (whitespace between turns, bos_token, a system turn folded into the first user
# turn), with {% generation %} markers around what the assistant says: the masks the markers give are what the
# unmarked templates' prefixes must give.
CHATML_RELEASED = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}{%- if m.role == 'assistant' %}{% generation %}"
    "{{- m.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}{%- else %}{{- m.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def _unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def _tokenizer(directory: Path, template: str, special: list[str] = SPECIAL, **specials) -> Path:
    """A byte-level BPE with the templates' special tokens and ``template``, saved as transformers saves one; eos
    ``<|endoftext|>`` unless ``specials`` say otherwise."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["what is the weather in Paris? It is sunny, thanks for asking."] * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=special,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, chat_template=template, **{"eos_token": "<|endoftext|>", **specials}
    ).save_pretrained(str(directory))
    return directory


def released_chat_model(directory: Path, *, max_positions: int = 128):
    """``(model, tokenizer)``: a tiny Llama chat model shaped as released ones are (a ChatML template without
    generation markers, eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, two stop ids in its generation config), its
    tokenizer saved in ``directory``; the caller saves the model there (``save_pretrained``) once it has set it up."""
    import torch
    import transformers

    _tokenizer(directory, _unmarked(CHATML_RELEASED), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            eos_token_id=end,
            bos_token_id=None,
            pad_token_id=None,
        )
    )
    model.generation_config = transformers.GenerationConfig(eos_token_id=[end, pad], pad_token_id=pad)
    return model, tokenizer


def _conversations(n: int = 12) -> list[dict]:
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for k in range(1 + i % 3):  # one to three exchanges
            turns += [
                {"role": "user", "content": f"question {i}.{k}: what is the weather?"},
                {"role": "assistant", "content": "sunny " * (1 + (i + k) % 4)},
            ]
        out.append({"messages": turns})
    return out

"""``prepare-data`` of chat and instruction JSONL: ids and loss masks token-identical to transformers' own
``apply_chat_template(..., return_assistant_tokens_mask=True)``, on three templates (ChatML, a Llama-3-style one,
one with tool calls), every record shape (messages, ShareGPT, prompt/completion, Alpaca), and the refusals.

The tokenizer is a byte-level BPE trained here, with the templates' special tokens; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat import CHATML, CHATML_RELEASED, SPECIAL, _conversations, _tokenizer, _unmarked
from paths import ROOT

from megakit.commands import cli

LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOOLS = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_MARKERS = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
LLAMA3_RELEASED = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{- m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
GEMMA_RELEASED = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\n\n' %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for m in turns %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}{%- if m['role'] == 'assistant' %}"
    "{% generation %}{{- m['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{- '\n' }}"
    "{%- else %}{{- m['content'] | trim + '<end_of_turn>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
GEMMA_SPECIAL = [*SPECIAL, "<bos>", "<start_of_turn>", "<end_of_turn>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _prepare(tmp_path, records, tokenizer, *extra) -> tuple[int, Path]:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    code = cli.main(
        [
            "prepare-data",
            str(data),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--val-fraction",
            "0",
            "--workers",
            "2",
            "--no-progress",
            *extra,
        ]
    )
    return code, out


def _documents(out: Path) -> list[tuple[list[int], list[int]]]:
    from megakit.interop.token_shards import open_shards

    shards = open_shards(out, verify=True)
    docs = []
    for ids, mask, starts in zip(shards.tokens("train"), shards.masks("train"), shards.documents("train")):
        for a, b in zip(starts, [*starts[1:], len(ids)]):
            docs.append((np.asarray(ids[a:b]).tolist(), np.asarray(mask[a:b]).tolist()))
    return docs


def _expected(hf, messages, tools=None):
    rendered = hf.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    return list(rendered["input_ids"]) + [eos], list(rendered["assistant_masks"]) + [0]


@pytest.mark.parametrize("name,template", [("chatml", CHATML), ("llama3", LLAMA3), ("tools", TOOLS)])
def test_masks_are_token_identical_to_transformers(tmp_path, name, template):
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(tmp_path / "tok", template)
    records = _conversations()
    if name == "tools":
        records = [
            {
                "tools": [WEATHER],
                "messages": [
                    {"role": "user", "content": f"weather in city {i}?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "weather", "arguments": {"city": f"city {i}"}}}
                        ],
                    },
                    {"role": "tool", "content": "sunny"},
                    {"role": "assistant", "content": "It is sunny."},
                ],
            }
            for i in range(6)
        ]
    code, out = _prepare(tmp_path, records, tokenizer)
    assert code == 0
    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    docs = _documents(out)
    assert len(docs) == len(records)
    for record, (ids, mask) in zip(records, docs):
        assert (ids, mask) == _expected(hf, record["messages"], record.get("tools"))
        assert 0 < sum(mask) < len(mask)
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True).chat_template == template  # it travels


def test_every_record_shape_renders_as_its_conversation(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(tmp_path / "tok", CHATML)
    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    user, answer = "what is the weather in Paris?", "It is sunny."
    records = [
        {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]},
        {"prompt": user, "completion": answer},
        {"instruction": "what is the weather", "input": "in Paris?", "output": answer},
        {"text": "a plain record among chat ones is skipped"},
    ]
    code, out = _prepare(tmp_path, records, tokenizer)
    assert code == 0
    sharegpt, completion, alpaca = _documents(out)
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    assert sharegpt == _expected(hf, messages)  # a conversation: the assistant's tokens
    prompt = hf.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True, return_dict=True)
    head = len(prompt["input_ids"])
    ids, mask = completion  # prompt-completion: everything after the generation prompt
    assert ids[:-1] == list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert mask == [0] * head + [1] * (len(ids) - 1 - head) + [0]
    assert alpaca[0][:-1] == list(
        hf.apply_chat_template(
            [{"role": "user", "content": "what is the weather\n\nin Paris?"}, messages[1]],
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    (tmp_path / "all").mkdir()
    code, out = _prepare(tmp_path / "all", _conversations(2), tokenizer, "--loss-on", "all")
    assert code == 0 and all(all(mask[:-1]) and not mask[-1] for _, mask in _documents(out))  # the separator: never


COUNTED = "{{ messages | length }} turns\n" + NO_MARKERS  # a prefix renders another count: no turn splits off


@pytest.mark.parametrize(
    "records,template,extra,needle",
    [
        (
            _conversations(2),
            CHATML,
            ["--chat-template", "counted.jinja"],
            "--chat-template {tmp}/counted.jinja cannot be split into turns: its first 2 messages render differently",
        ),
        (
            _conversations(2),
            NO_MARKERS,
            ["--loss-on", "completion", "--chat-template", "counted.jinja"],
            "--chat-template {tmp}/counted.jinja cannot be split into turns: the prompt renders differently",
        ),
        (
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}],
            CHATML,
            [],
            "the inputs hold no chat record to train on: all 1 are malformed or leave no token to train on, e.g. "
            "{tmp}/chats.jsonl, the line at byte 0 (message 2 (assistant) has no content)",
        ),
        ([{"messages": [{"role": "wizard", "content": "hi"}]}], CHATML, [], "has the role 'wizard'; the roles are"),
        ([{"conversations": [{"from": "robot", "value": "hi"}]}], CHATML, [], "a ShareGPT turn has from='robot'"),
    ],
    ids=["unsplittable", "unsplittable-completion", "null-content-only", "unknown-role", "unknown-sharegpt"],
)
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, records, template, extra, needle):
    (tmp_path / "counted.jinja").write_text(COUNTED)
    tokenizer = _tokenizer(tmp_path / "tok", template)
    extra = [str(tmp_path / e) if e.endswith(".jinja") else e for e in extra]
    needle = needle.format(tmp=tmp_path)
    code, out = _prepare(tmp_path, records, tokenizer, *extra)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize(
    "marked", [CHATML_RELEASED, LLAMA3_RELEASED, GEMMA_RELEASED], ids=["chatml", "llama3", "gemma"]
)
def test_templates_without_markers_mask_the_assistant_as_their_markers_do(tmp_path, capsys, marked):
    """A released template has no {% generation %} markers: the assistant's turns are found by rendering prefixes,
    and the mask is token for token the one transformers reads from the same template with markers (system turns,
    one to three exchanges); prepare-data shows the first example with the counted tokens marked."""
    from transformers import PreTrainedTokenizerFast

    specials = {"chatml": {}, "llama3": {"bos_token": "<|begin_of_text|>"}, "gemma": {"bos_token": "<bos>"}}[
        _name(marked)
    ]
    tokenizer = _tokenizer(tmp_path / "tok", _unmarked(marked), GEMMA_SPECIAL if specials else SPECIAL, **specials)
    records = _conversations()
    code, out = _prepare(tmp_path, records, tokenizer, "--loss-on", "assistant")
    assert code == 0
    from tokenizers import Tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer / "tokenizer.json")),
        chat_template=marked,
        eos_token="<|endoftext|>",
        **specials,
    )
    docs = _documents(out)
    assert len(docs) == len(records)
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
    for record, (ids, mask) in zip(records, docs):
        want = _expected(hf, record["messages"])
        assert (ids, mask) == want
        if specials:
            assert ids[0] == hf.bos_token_id  # the template's {{ bos_token }} is the tokenizer's
        turns = sum(m["role"] == "assistant" for m in record["messages"])
        ended = [i for i in range(len(ids)) if mask[i] and ids[i] == hf.convert_tokens_to_ids(end[_name(marked)])]
        assert len(ended) == turns  # each assistant turn's end-of-turn token counts: the model learns to stop
    shown = capsys.readouterr().out
    assert f"{end[_name(marked)]}]]" in shown and "[[sunny" in shown, shown


def test_a_long_first_example_is_cut_in_index_json_as_on_the_console(tmp_path, capsys):
    """The first example, marked, is kept in index.json's summary: cut as the console's is, not a whole long
    conversation."""
    tokenizer = _tokenizer(tmp_path / "tok", NO_MARKERS)
    long = {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny " * 1000}]}
    code, out = _prepare(tmp_path, [long], tokenizer)
    assert code == 0
    example = json.loads((out / "index.json").read_text())["summary"]["example"]
    assert example.startswith("<|im_start|>user") and example.endswith(" characters more)"), example[-200:]
    assert len(example) < 2100 and example in capsys.readouterr().out


# Mistral's and Llama 2 chat's template: no generation prompt, the reply follows [/INST] and ends with </s>
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
)


def test_a_template_without_a_generation_prompt_trains_each_reply_and_its_end(tmp_path, capsys):
    """Mistral's [INST] template has no add_generation_prompt branch: under the default --loss-on auto each reply
    and its </s> count, as its markers say; a conversation that opens with the assistant (which transformers will
    not render a prefix of) is trained from its start, and one the template refuses (roles that do not alternate)
    is counted and skipped: neither stops the run."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megakit.interop.chat_data import marked

    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    tokenizer = _tokenizer(tmp_path / "tok", _unmarked(MISTRAL), [*SPECIAL, "<s>", "</s>"], **specials)
    records = [r for r in _conversations(6) if r["messages"][0]["role"] == "user"]
    opening = [
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "sunny"},
    ]
    unordered = [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}]
    code, out = _prepare(tmp_path, [*records, {"messages": unordered}], tokenizer)
    assert code == 0
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer / "tokenizer.json")), chat_template=MISTRAL, **specials
    )
    docs = _documents(out)
    assert docs == [_expected(hf, r["messages"]) for r in records]
    for record, (ids, mask) in zip(records, docs):
        ended = [i for i in range(len(ids)) if mask[i] and ids[i] == hf.eos_token_id]
        assert len(ended) == sum(m["role"] == "assistant" for m in record["messages"])
    assert "skipped 1 chat records" in capsys.readouterr().out
    chatml = _tokenizer(tmp_path / "chatml", NO_MARKERS)
    (tmp_path / "opening").mkdir()
    code, out = _prepare(tmp_path / "opening", [{"messages": opening}], chatml)
    assert code == 0, capsys.readouterr().err
    [(ids, mask)] = _documents(out)
    shown = marked(Tokenizer.from_file(str(chatml / "tokenizer.json")), ids, mask).replace("\n", "")
    assert (
        shown == "[[<|im_start|>assistanthello<|im_end|>]]<|im_start|>userhi<|im_end|><|im_start|>assistant"
        "[[sunny<|im_end|>]]<|endoftext|>"
    ), shown


def _name(template: str) -> str:
    return "chatml" if template is CHATML_RELEASED else "llama3" if template is LLAMA3_RELEASED else "gemma"


def test_a_chat_template_file_travels_in_place_of_the_tokenizers(tmp_path):
    """--chat-template FILE renders the data and replaces the tokenizer's own template in the data directory (so in
    checkpoints and the export); the tokenizer's special tokens travel as they were."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(tmp_path / "tok", NO_MARKERS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (tmp_path / "marked.jinja").write_text(CHATML_RELEASED)
    code, out = _prepare(tmp_path, _conversations(3), tokenizer, "--chat-template", str(tmp_path / "marked.jinja"))
    assert code == 0
    saved = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert saved.chat_template == CHATML_RELEASED and (saved.eos_token, saved.pad_token) == (
        "<|im_end|>",
        "<|endoftext|>",
    )
    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    hf.chat_template = CHATML_RELEASED
    assert _documents(out) == [_expected(hf, r["messages"]) for r in _conversations(3)]


@pytest.mark.parametrize(
    "template", [CHATML_RELEASED, NO_MARKERS.replace("m['content']", "m.content")], ids=["m.content", "m['content']"]
)
def test_a_message_without_content_is_skipped_and_counted_for_every_template(tmp_path, capsys, template):
    """A message with no content, or a null one, is a malformed record whichever way the template reads it: counted,
    named and skipped, never a Jinja traceback nor an empty turn trained on."""
    tokenizer = _tokenizer(tmp_path / "tok", _unmarked(template))
    good = _conversations(2)
    records = [
        good[0],
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "sunny"}]},
        {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "sunny"}]},
        good[1],
    ]
    code, out = _prepare(tmp_path, records, tokenizer)
    assert code == 0
    assert len(_documents(out)) == 2
    said = capsys.readouterr().out
    assert "skipped 3 chat records" in said and "(message 2 (assistant) has no content)" in said, said


def test_eos_not_in_the_vocabulary_is_refused(tmp_path, capsys):
    """A chat model whose eos is not a token could never stop: one line, exit 2, nothing written, whether its
    tokenizer_config.json names a token the vocabulary lacks, or its generation config an id past the vocabulary
    (at prepare-data, and at convert --from-hf)."""
    tokenizer = _tokenizer(tmp_path / "tok", CHATML, eos_token="<|im_end|>")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_stop|>"}))
    code, out = _prepare(tmp_path, _conversations(2), tokenizer)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the eos token '<|im_stop|>' is not in the tokenizer's" in err, err
    assert not out.exists()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    (tokenizer / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4000]}))
    (tokenizer / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 400}))
    code, out = _prepare(tmp_path, _conversations(2), tokenizer)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "its eos_token_id [2, 4000] is not in the tokenizer's vocabulary of" in err, err
    assert not out.exists()
    code = cli.main(["convert", str(tokenizer), str(tmp_path / "ck"), "--from-hf"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "eos_token_id [2, 4000] is not in the model's vocabulary" in err, err
    assert not (tmp_path / "ck").exists()


def test_an_eos_id_that_is_not_an_id_is_one_line_at_prepare_import_and_export(tmp_path, capsys):
    """One check of the model's eos ids serves prepare-data, convert --from-hf and --to-hf: an id that is not a
    number (a null in generation_config.json) is refused in one line at each, as an id past the vocabulary is."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=400,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    ).save_pretrained(tmp_path / "hf")
    hf = _tokenizer(tmp_path / "hf", CHATML)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, None]}))
    capsys.readouterr()  # save_pretrained's progress bar
    code, out = _prepare(tmp_path, _conversations(2), hf)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "its eos_token_id [2, None] is not in the tokenizer's" in err, err
    assert cli.main(["convert", str(hf), str(tmp_path / "ck"), "--from-hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its eos_token_id [2, None] is not in the model's vocabulary of 400" in err, err
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert cli.main(["convert", str(hf), str(tmp_path / "ck"), "--from-hf"]) == 0
    (tmp_path / "ck" / "tokenizer" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, None]}))
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "back"), "--to-hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its eos_token_id [2, None] is not in the model's vocabulary of 400" in err, err
    assert not (tmp_path / "back").exists()


def test_convert_from_hf_carries_no_tokenizer_built_from_nothing(tmp_path, capsys):
    """A model directory with a tokenizer_config.json but no vocabulary imports without a tokenizer and says so in
    one line (transformers 5 would build one of three special tokens from nothing, and it would travel into the
    checkpoint and the export); a broken tokenizer.json is one line naming the file, not a --tokenizer flag that
    convert does not have."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    ).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"})
    )
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 0
    said = capsys.readouterr().out
    assert f"convert: note: {tmp_path / 'hf'} has a tokenizer_config.json but no tokenizer.json" in said, said
    assert "its tokenizer" not in said and not (tmp_path / "ck" / "tokenizer").exists()
    (tmp_path / "text.txt").write_text("the weather is sunny\n" * 50)  # nor is data prepared with one
    assert (
        cli.main(
            [
                "prepare-data",
                str(tmp_path / "text.txt"),
                "--tokenizer",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "data"),
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no tokenizer.json nor a slow tokenizer's vocabulary" in err, err
    (tmp_path / "hf" / "tokenizer.json").write_text("{not json")
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck2"), "--from-hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {tmp_path / 'hf' / 'tokenizer.json'} is not a tokenizers JSON" in err, err
    assert not (tmp_path / "ck2").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--chat"], "--chat needs --prompt TEXT"),
        (["--messages", "{tmp}/bad.json"], "--messages {tmp}/bad.json: give a JSON list of"),
        (["--messages", "{tmp}/none.json"], "--messages {tmp}/none.json: cannot read it as JSON"),
        ([], "give --prompt TEXT"),
        (["--messages", "{tmp}/empty.json"], "--messages {tmp}/empty.json: the conversation is empty"),
        (
            ["--messages", "{tmp}/twice.json"],
            "--messages {tmp}/twice.json: the model's chat template cannot render it "
            "(Conversation roles must alternate",
        ),
    ],
    ids=["chat-without-prompt", "not-messages", "no-file", "nothing", "empty", "template-refuses"],
)
def test_generate_refuses_a_conversation_it_cannot_read(tmp_path, capsys, args, needle):
    """One line, exit 2, never a traceback: the model (a transformers directory) is not loaded."""
    (tmp_path / "bad.json").write_text(json.dumps({"messages": [{"role": "user", "content": None}]}))
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "twice.json").write_text(json.dumps([{"role": "user", "content": "hi"}] * 2))
    model = _tokenizer(tmp_path / "model", _unmarked(MISTRAL), [*SPECIAL, "<s>", "</s>"], eos_token="</s>")
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code = cli.main(["generate", str(model), *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle.format(tmp=tmp_path) in err, err


def test_no_markers_train_the_completion_and_chat_needs_a_tokenizer(tmp_path, capsys):
    """Without markers, --loss-on completion still finds the last assistant turn (by the prompt's rendering)."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(tmp_path / "tok", NO_MARKERS)
    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    records = _conversations(3)
    code, out = _prepare(tmp_path, records, tokenizer, "--loss-on", "completion")
    assert code == 0
    for record, (ids, mask) in zip(records, _documents(out)):
        head = len(
            hf.apply_chat_template(
                record["messages"][:-1], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        assert mask == [0] * head + [1] * (len(ids) - 1 - head) + [0]
    (tmp_path / "plain.jsonl").write_text(json.dumps(records[0]) + "\n")
    code = cli.main(["prepare-data", str(tmp_path / "plain.jsonl"), "--out", str(tmp_path / "p"), "--no-progress"])
    assert code == 2 and "pass --tokenizer DIR" in capsys.readouterr().err


def _shards(out: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    from megakit.interop.token_shards import open_shards

    shards = open_shards(out, verify=True)
    return [
        (np.asarray(ids).tolist(), np.asarray(mask).tolist())
        for ids, mask in zip(shards.tokens(split), shards.masks(split))
    ]


def test_parquet_and_saved_data_sets_read_as_their_jsonl(tmp_path):
    """The same records as JSONL, as Parquet in row groups of 5 (pieces over both workers), as a
    ``datasets.save_to_disk`` directory and as a DatasetDict's: the same tokens and loss masks, the same split."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = _tokenizer(tmp_path / "tok", CHATML)
    records = _conversations(23)
    code, jsonl = _prepare(tmp_path, records, tokenizer, "--val-fraction", "0.2")
    assert code == 0
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet", row_group_size=5)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:2])}
    ).save_to_disk(str(tmp_path / "dict"))
    for source in ("chats.parquet", "saved", "dict"):
        out = tmp_path / f"from-{source}"
        code = cli.main(
            [
                "prepare-data",
                str(tmp_path / source),
                "--tokenizer",
                str(tokenizer),
                "--out",
                str(out),
                "--val-fraction",
                "0.2",
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        assert code == 0, source
        for split in ("train", "validation"):
            assert _shards(out, split) == _shards(jsonl, split), (source, split)


def test_plain_text_parquet_and_a_bad_file(tmp_path, capsys):
    """A Parquet ``text`` column trains like JSONL text; a file that is not Parquet is skipped with a warning."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + "the quick brown fox " * (i + 1) for i in range(40)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"body": texts, "n": list(range(40))}), tmp_path / "b" / "docs.parquet", row_group_size=7)
    (tmp_path / "b" / "junk.parquet").write_bytes(b"not parquet at all")
    outs = []
    for name in ("a", "b"):
        outs.append(tmp_path / f"out-{name}")
        assert (
            cli.main(
                [
                    "prepare-data",
                    str(tmp_path / name),
                    "--field",
                    "body",
                    "--vocab-size",
                    "300",
                    "--out",
                    str(outs[-1]),
                    "--val-fraction",
                    "0",
                    "--no-progress",
                ]
            )
            == 0
        )
    from megakit.interop.token_shards import open_shards

    a, b = (open_shards(o, verify=True) for o in outs)
    assert [np.asarray(t).tolist() for t in a.tokens("train")] == [np.asarray(t).tolist() for t in b.tokens("train")]
    assert "skipped 1 of 2 files" in capsys.readouterr().out


def test_chat_examples_are_held_out_whole(tmp_path):
    """With --val-fraction, a chat example goes to training or to validation whole, never a reply without its
    prompt, and validation holds about the fraction of the tokens."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(tmp_path / "tok", CHATML)
    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    records = _conversations(40)
    code, out = _prepare(tmp_path, records, tokenizer, "--val-fraction", "0.25")
    assert code == 0
    expected = [_expected(hf, r["messages"]) for r in records]
    from megakit.interop.token_shards import open_shards

    shards = open_shards(out, verify=True)
    got = {}
    for split in ("train", "validation"):
        got[split] = []
        for ids, mask, starts in zip(shards.tokens(split), shards.masks(split), shards.documents(split)):
            got[split] += [
                (np.asarray(ids[a:b]).tolist(), np.asarray(mask[a:b]).tolist())
                for a, b in zip(starts, [*starts[1:], len(ids)])
            ]
    assert sorted(got["train"] + got["validation"]) == sorted(expected)  # every example whole, on one side
    held = sum(len(ids) for ids, _ in got["validation"]) / sum(len(ids) for ids, _ in expected)
    assert got["validation"] and abs(held - 0.25) < 0.05, held


def test_the_transformers_floor_has_the_renderer_chat_data_calls():
    """chat_data reads {% generation %} spans with transformers' render_jinja_template, added in 4.52 (4.51.3 has
    none): the floor pyproject.toml declares must be at least that, or an older install fails on the first chat."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11

    from megakit.interop import chat_data

    assert "render_jinja_template" in Path(chat_data.__file__).read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [floor] = [d.split(">=")[1] for d in pyproject["project"]["dependencies"] if d.startswith("transformers")]
    assert tuple(int(p) for p in floor.split(".")[:2]) >= (4, 52), floor

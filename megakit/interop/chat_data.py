"""Chat and instruction records to token ids and a loss mask, rendered with the tokenizer's own chat template.

The shapes people have (one JSON object per JSONL line), as TRL, axolotl and LLaMA-Factory name them:

- ``{"messages": [{"role", "content", "tool_calls"?}, ...], "tools"?}``: a conversation (OpenAI, TRL);
- ``{"conversations": [{"from", "value"}, ...]}``: ShareGPT (``human``/``gpt``/``system``/``tool``...);
- ``{"prompt", "completion"}``: strings, or message lists as TRL allows;
- ``{"instruction", "input"?, "output"}``: Alpaca (instruction and input become the user's turn).

A message needs its ``content`` (a string, or a list of parts): one without (or ``null``) is a malformed record,
counted and skipped before any template reads it, so every template treats it alike (transformers drops a null
key, and a template then renders an empty turn or fails inside Jinja). An assistant turn of only ``tool_calls``
is the exception.

Which tokens the loss counts (``--loss-on``; the mask is 1 there):

- ``assistant``: the assistant's turns. A template with ``{% generation %}`` markers says which tokens they are
  (transformers' ``return_assistant_tokens_mask``). Most released templates (ChatML among them) have none: then
  the conversation is rendered prefix by prefix (axolotl finds turns by comparing renders too), and an assistant
  turn is what it adds to the prompt before it (rendered with the generation prompt), less the whitespace the
  template puts between turns: its content and its end-of-turn token. On templates with markers the two agree
  token for token (a test checks ChatML, Llama 3 and Gemma styles). A template with no generation prompt
  (Mistral's and Llama 2's ``[INST]`` ones) gives the turn after the prompt rendered bare: its reply and ``</s>``.
  A template whose prefixes do not render as the start of the whole cannot be split into turns, and is refused.
- ``completion``: what follows the prompt, the prompt rendered with ``add_generation_prompt=True``; for a
  conversation, its last assistant turn (checked on every record, as above).
- ``all``: every token.

``auto`` (the default) is ``assistant`` for conversations and ``completion`` for prompt-completion and Alpaca
records. Plain prompt-completion text without a chat template is the prompt's ids then the completion's.
"""

from __future__ import annotations

import re

from megakit.errors import UsageError

LOSS_ON = ("auto", "assistant", "completion", "all")
ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
CHAT_KEYS = ("messages", "conversations", "prompt", "instruction")
EXAMPLE_CHARS = 2000  # of the example shown (and kept in index.json) with its counted tokens marked


def is_chat(record: dict) -> bool:
    """Whether a record is one of the chat or instruction shapes (else plain text)."""
    return any(key in record for key in CHAT_KEYS)


def has_generation_markers(template: str | None) -> bool:
    """Whether the template marks assistant turns, which lets prepare-data train on the replies alone."""
    return bool(template) and GENERATION.search(template) is not None


def _content(message: dict, n: int) -> None:
    """A message's ``content`` is text (or a list of parts); only an assistant turn of tool calls may lack it."""
    content = message.get("content")
    if isinstance(content, (str, list)) or (content is None and message.get("tool_calls")):
        return
    what = "no content" if content is None else f"a content of type {type(content).__name__}"
    raise ValueError(f"message {n + 1} ({message.get('role')}) has {what}")


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError("not a list of messages")
    for message in value:
        role = message.get("role")
        if role not in ROLES:
            raise UsageError(
                f"{where}: a message has the role {role!r}; the roles are {', '.join(ROLES)} (map other "
                "names to them, or give ShareGPT data as 'conversations' with from/value)"
            )
    for n, message in enumerate(value):
        _content(message, n)
    return value


def conversation(record: dict, where: str) -> tuple[list[dict], list[dict] | None]:
    """``(prompt messages, completion messages or None)`` of a record: a conversation is all prompt (None), a
    prompt-completion or Alpaca record is split where its answer starts. ValueError for a malformed record (it is
    counted and skipped); UsageError for a role no template knows (the whole file is wrong, not one line)."""
    if "messages" in record:
        return _messages(record["messages"], where), None
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list):
            raise ValueError("conversations is not a list")
        out = []
        for turn in turns:
            role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            if role is None:
                raise UsageError(
                    f"{where}: a ShareGPT turn has from={turn.get('from') if isinstance(turn, dict) else turn!r}; "
                    f"the known ones are {', '.join(SHAREGPT_ROLES)}"
                )
            out.append({"role": role, "content": turn.get("value")})
        for n, message in enumerate(out):
            _content(message, n)
        return out, None
    if "prompt" in record:
        prompt, completion = record["prompt"], record.get("completion")
        answer = (
            [{"role": "assistant", "content": completion}]
            if isinstance(completion, str)
            else _messages(completion, where)
        )
        return _messages(prompt, where), answer
    instruction, extra, output = record.get("instruction"), record.get("input") or "", record.get("output")
    if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
        raise ValueError("an Alpaca record needs instruction and output strings")
    user = instruction + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}], [{"role": "assistant", "content": output}]


def _malformed() -> tuple:
    """What one bad record raises, counted and skipped: Python's errors, and Jinja's (a template's
    ``raise_exception``, e.g. "roles must alternate")."""
    from jinja2 import TemplateError

    return ValueError, TypeError, KeyError, AttributeError, TemplateError


def _or_skip(render, *args):
    """``render(*args)``, or the ValueError that skips a malformed record; a UsageError (the whole input is wrong,
    not one line) goes on up."""
    try:
        return render(*args)
    except UsageError:
        raise
    except _malformed() as error:
        return ValueError(str(error).splitlines()[0] if str(error) else type(error).__name__)


def token_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span: transformers' rule for ``{% generation %}`` spans, so the
    spans found by prefixes give its mask."""
    mask, k = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def marked(tokenizer, ids, mask, *, open_: str = "[[", close: str = "]]", limit: int = EXAMPLE_CHARS) -> str:
    """The example as text, each run of tokens the loss counts between ``open_`` and ``close``: what prepare-data
    shows so the mask can be checked by eye; past ``limit`` characters, cut (a long conversation would fill the
    console and index.json) with how many more there are."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode([int(t) for t in ids[start:i]], skip_special_tokens=False)
            out.append(f"{open_}{text}{close}" if mask[start] else text)
            start = i
    text = "".join(out)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit:,} characters more)"


class ChatRenderer:
    """Renders records with one tokenizer and template; ``ids_and_mask(record)`` -> two lists of equal length.

    ``specials``: the tokenizer's special tokens (``bos_token``, ``eos_token``...), which templates read as
    variables; ``source``: where the template came from, for the messages."""

    def __init__(
        self,
        tokenizer,
        template: str | None,
        loss_on: str,
        specials: dict | None = None,
        source: str = "the chat template",
        *,
        eos: int | None,
    ) -> None:
        from transformers import PreTrainedTokenizerFast

        self.fast = (
            PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **(specials or {}))
            if template
            else None
        )
        self.markers = has_generation_markers(template)
        self.tokenizer, self.loss_on, self.eos, self.source = tokenizer, loss_on, eos, source

    def _render(self, messages, *, tools=None, generation_prompt=False, assistant_mask=False):
        out = self.fast.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
            return_assistant_tokens_mask=assistant_mask,
        )
        return list(out["input_ids"]), list(out.get("assistant_masks", []))

    def _text(self, messages, tools=None, generation_prompt=False) -> str:
        return self.fast.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def assistant_spans(self, messages: list[dict], tools, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns, by rendering it prefix by
        prefix: turn i is what ``messages[:i + 1]`` adds to ``messages[:i]`` rendered with the generation prompt,
        its trailing whitespace (the template's, between turns) left out. UsageError where the prefixes do not
        render as the start of the whole: no turn can be told apart. A template with no generation prompt
        (Mistral's, Llama 2's ``[INST]`` ones) renders the prompt bare, and the turn is what follows it; an opening
        assistant turn (nothing before it, which transformers will not render) is what the conversation starts
        with."""
        full = self._text(messages, tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                head, turn = self._text(messages[:i], tools, True) if i else "", self._text(messages[: i + 1], tools)
            except _malformed() as error:
                raise self._unsplittable(where, f"its first {i} messages do not render ({error})") from None
            if not turn.startswith(head) or not full.startswith(turn):
                raise self._unsplittable(
                    where,
                    f"its first {i + 1 if turn.startswith(head) else i} messages render "
                    "differently alone than as the start of the whole conversation",
                )
            end = len(turn.rstrip())
            if end > len(head):
                spans.append((len(head), end))
        return full, spans

    def _unsplittable(self, where: str, why: str) -> UsageError:
        return UsageError(
            f"{where}: {self.source} cannot be split into turns: {why}; give --chat-template FILE "
            "whose assistant content sits in {% generation %} ... {% endgeneration %}, or use "
            "--loss-on all"
        )

    def many(self, records: list[tuple[dict, str]]) -> list:
        """``ids_and_mask`` of each ``(record, where)``, or the ValueError that skips it. The conversations the
        assistant mask reads are tokenized in one batched call: the same ids and masks, at several times the speed
        of one call each."""
        out: list = [None] * len(records)
        batch = []  # (index, text, spans)
        for i, (record, where) in enumerate(records):
            parsed = _or_skip(conversation, record, where)
            if isinstance(parsed, ValueError):
                out[i] = parsed
                continue
            prompt, completion = parsed
            if self.fast is not None and self._mode(completion) == "assistant":
                rendered = _or_skip(self._spans, prompt + (completion or []), record.get("tools"), where)
                if isinstance(rendered, ValueError):
                    out[i] = rendered
                else:
                    batch.append((i, *rendered))
        if batch:
            encoded = self.fast([text for _, text, _ in batch], add_special_tokens=False)
            for j, (i, _, spans) in enumerate(batch):
                mask = token_mask(encoded.encodings[j].offsets, spans)
                out[i] = (
                    self._finish(list(encoded["input_ids"][j]), mask)
                    if any(mask)
                    else ValueError("no token to train on")
                )
        for i, (record, where) in enumerate(records):
            if out[i] is None:
                out[i] = _or_skip(self.ids_and_mask, record, where)
        return out

    def _spans(self, messages: list[dict], tools, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The text and assistant spans: the template's ``{% generation %}`` markers where it has them, else its
        prefixes."""
        if not self.markers:
            return self.assistant_spans(messages, tools, where)
        from transformers.utils.chat_template_utils import render_jinja_template

        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as apply_chat_template does
        texts, spans = render_jinja_template(
            conversations=[plain],
            tools=tools,
            chat_template=self.fast.chat_template,
            return_assistant_tokens_mask=True,
            **self.fast.special_tokens_map,
        )
        return texts[0], [tuple(s) for s in spans[0]]

    def _mode(self, completion) -> str:
        """What ``auto`` means for a record: the assistant's tokens of a conversation, else the completion."""
        return self.loss_on if self.loss_on != "auto" else "assistant" if completion is None else "completion"

    def _finish(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if self.eos is not None:  # the document separator, predicted by nothing the loss counts
            return ids + [self.eos], mask + [0]
        return ids, mask

    def ids_and_mask(self, record: dict, where: str) -> tuple[list[int], list[int]]:
        """A record's token ids and loss mask (1 where the model learns to reply); UsageError names a bad record."""
        prompt, completion = conversation(record, where)
        mode = self._mode(completion)
        tools = record.get("tools")
        if self.fast is None:  # no template: a prompt-completion record as plain text
            if completion is None or any(not isinstance(m.get("content"), str) for m in prompt + completion):
                raise UsageError(
                    f"{where}: conversations need a chat template, and the tokenizer has none; pass "
                    "--chat-template FILE (a Jinja template) or a --tokenizer whose config holds one"
                )
            head = self.tokenizer.encode("".join(m["content"] for m in prompt), add_special_tokens=False).ids
            tail = self.tokenizer.encode("".join(m["content"] for m in completion), add_special_tokens=False).ids
            ids, mask = head + tail, [0] * len(head) + [1] * len(tail)
        elif mode == "all":
            ids, _ = self._render(prompt + (completion or []), tools=tools)
        elif mode == "assistant":
            text, spans = self._spans(prompt + (completion or []), tools, where)
            encoded = self.fast(text, add_special_tokens=False)
            ids, mask = list(encoded["input_ids"]), token_mask(encoded.encodings[0].offsets, spans)
        else:
            if completion is None:  # a conversation: its last assistant turn is the completion
                last = max((i for i, m in enumerate(prompt) if m["role"] == "assistant"), default=None)
                if last is None:
                    raise ValueError("no assistant turn")
                prompt, completion = prompt[:last], prompt[last:]
            ids, _ = self._render(prompt + completion, tools=tools)
            head = self._render(prompt, tools=tools, generation_prompt=True)[0] if prompt else []
            if ids[: len(head)] != head:
                raise self._unsplittable(
                    where,
                    "the prompt renders differently alone than inside the whole "
                    "conversation, so the completion's tokens cannot be told apart",
                )
            mask = [0] * len(head) + [1] * (len(ids) - len(head))
        if mode == "all":
            mask = [1] * len(ids)
        if not any(mask):
            raise ValueError("no token to train on")
        return self._finish(ids, mask)

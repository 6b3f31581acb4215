"""Chat and instruction records to token ids and a loss mask, rendered with the tokenizer's own chat template.

The shapes people have (one JSON object per JSONL line), as TRL, axolotl and LLaMA-Factory name them:

- ``{"messages": [{"role", "content", "tool_calls"?}, ...], "tools"?}``: a conversation (OpenAI, TRL);
- ``{"conversations": [{"from", "value"}, ...]}``: ShareGPT (``human``/``gpt``/``system``/``tool``...);
- ``{"prompt", "completion"}``: strings, or message lists as TRL allows;
- ``{"instruction", "input"?, "output"}``: Alpaca (instruction and input become the user's turn).

Which tokens the loss counts (``--loss-on``; the mask is 1 there):

- ``assistant``: the tokens the template marks as the assistant's (``{% generation %}`` blocks), read with
  transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``. A template without the
  markers gives an all-zero mask (transformers only warns, and the run trains on nothing), so it is refused.
- ``completion``: what follows the prompt, the prompt rendered with ``add_generation_prompt=True``; for a
  conversation, its last assistant turn. Needs no markers, only a template that renders the prompt as the
  start of the whole (checked on every record).
- ``all``: every token.

``auto`` (the default) is ``assistant`` for conversations and ``completion`` for prompt-completion and Alpaca
records. Plain prompt-completion text without a chat template is the prompt's ids then the completion's.
"""

from __future__ import annotations

import re

from megakit.errors import UsageError

LOSS_ON = ("auto", "assistant", "completion", "all")
ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
CHAT_KEYS = ("messages", "conversations", "prompt", "instruction")


def is_chat(record: dict) -> bool:
    """Whether a record is one of the chat or instruction shapes (else plain text)."""
    return any(key in record for key in CHAT_KEYS)


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and GENERATION.search(template) is not None


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError("not a list of messages")
    for message in value:
        role = message.get("role")
        if role not in ROLES:
            raise UsageError(f"{where}: a message has the role {role!r}; the roles are {', '.join(ROLES)} (map other "
                             "names to them, or give ShareGPT data as 'conversations' with from/value)")
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
                raise UsageError(f"{where}: a ShareGPT turn has from={turn.get('from') if isinstance(turn, dict) else turn!r}; "
                                 f"the known ones are {', '.join(SHAREGPT_ROLES)}")
            out.append({"role": role, "content": turn.get("value")})
        return out, None
    if "prompt" in record:
        prompt, completion = record["prompt"], record.get("completion")
        answer = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                  else _messages(completion, where))
        return _messages(prompt, where), answer
    instruction, extra, output = record.get("instruction"), record.get("input") or "", record.get("output")
    if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
        raise ValueError("an Alpaca record needs instruction and output strings")
    user = instruction + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}], [{"role": "assistant", "content": output}]


MALFORMED = (ValueError, TypeError, KeyError, AttributeError)  # what one bad record raises: counted and skipped


def _or_skip(render, *args):
    """``render(*args)``, or the ValueError that skips a malformed record; a UsageError (the whole input is wrong,
    not one line) goes on up."""
    try:
        return render(*args)
    except UsageError:
        raise
    except MALFORMED as error:
        return ValueError(str(error))


class ChatRenderer:
    """Renders records with one tokenizer and template; ``ids_and_mask(record)`` -> two lists of equal length."""

    def __init__(self, tokenizer, template: str | None, loss_on: str, eos: int | None) -> None:
        from transformers import PreTrainedTokenizerFast

        self.fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template) if template else None
        self.tokenizer, self.loss_on, self.eos = tokenizer, loss_on, eos

    def _render(self, messages, *, tools=None, generation_prompt=False, assistant_mask=False):
        out = self.fast.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt,
                                            return_assistant_tokens_mask=assistant_mask)
        return list(out["input_ids"]), list(out.get("assistant_masks", []))

    def many(self, records: list[tuple[dict, str]]) -> list:
        """``ids_and_mask`` of each ``(record, where)``, or the ValueError that skips it. The conversations the
        assistant mask reads (no tools) are rendered in one batched ``apply_chat_template`` call, which tokenizes
        them together: the same ids and masks, at several times the speed of one call each."""
        out: list = [None] * len(records)
        batch = []
        for i, (record, where) in enumerate(records):
            parsed = _or_skip(conversation, record, where)
            if isinstance(parsed, ValueError):
                out[i] = parsed
                continue
            prompt, completion = parsed
            if self.fast is not None and self._mode(completion) == "assistant" and not record.get("tools"):
                batch.append((i, prompt + (completion or [])))
        if batch:
            try:
                rendered = self.fast.apply_chat_template([m for _, m in batch], tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
                pairs = zip(rendered["input_ids"], rendered["assistant_masks"])
            except Exception:  # noqa: BLE001 (a template error in one record): each is rendered on its own below
                pairs = []
            for (i, _), (ids, mask) in zip(batch, pairs):
                out[i] = self._finish(list(ids), list(mask)) if any(mask) else ValueError("no token to train on")
        for i, (record, where) in enumerate(records):
            if out[i] is None:
                out[i] = _or_skip(self.ids_and_mask, record, where)
        return out

    def _mode(self, completion) -> str:
        """What ``auto`` means for a record: the assistant's tokens of a conversation, else the completion."""
        return self.loss_on if self.loss_on != "auto" else "assistant" if completion is None else "completion"

    def _finish(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if self.eos is not None:  # the document separator, predicted by nothing the loss counts
            return ids + [self.eos], mask + [0]
        return ids, mask

    def ids_and_mask(self, record: dict, where: str) -> tuple[list[int], list[int]]:
        prompt, completion = conversation(record, where)
        mode = self._mode(completion)
        tools = record.get("tools")
        if self.fast is None:  # no template: a prompt-completion record as plain text
            if completion is None or any(not isinstance(m.get("content"), str) for m in prompt + completion):
                raise UsageError(f"{where}: conversations need a chat template, and the tokenizer has none; pass "
                                 "--chat-template FILE (a Jinja template) or a --tokenizer whose config holds one")
            head = self.tokenizer.encode("".join(m["content"] for m in prompt), add_special_tokens=False).ids
            tail = self.tokenizer.encode("".join(m["content"] for m in completion), add_special_tokens=False).ids
            ids, mask = head + tail, [0] * len(head) + [1] * len(tail)
        elif mode == "all":
            ids, _ = self._render(prompt + (completion or []), tools=tools)
        elif mode == "assistant":
            ids, mask = self._render(prompt + (completion or []), tools=tools, assistant_mask=True)
        else:
            if completion is None:  # a conversation: its last assistant turn is the completion
                last = max((i for i, m in enumerate(prompt) if m["role"] == "assistant"), default=None)
                if last is None:
                    raise ValueError("no assistant turn")
                prompt, completion = prompt[:last], prompt[last:]
            ids, _ = self._render(prompt + completion, tools=tools)
            head, _ = self._render(prompt, tools=tools, generation_prompt=True)
            if ids[:len(head)] != head:
                raise UsageError(f"{where}: the chat template renders the prompt differently inside the whole "
                                 "conversation, so the completion's tokens cannot be told apart; use --loss-on "
                                 "assistant with a template that has {% generation %} markers")
            mask = [0] * len(head) + [1] * (len(ids) - len(head))
        if mode == "all":
            mask = [1] * len(ids)
        if not any(mask):
            raise ValueError("no token to train on")
        return self._finish(ids, mask)

"""Fine-tuning data formats: what a record holds, recognised from its fields, checked, made uniform.

Formats (`--dataset-format`, default `auto`: recognised from the fields of the first record):

- `text`: a text field (`--text-field`); pretraining-style, every token trained.
- `prompt-completion`: `prompt` and `completion`, each a string or a list of messages.
- `messages`: a list of `{role, content}` turns; roles system, user, assistant, tool.
- `alpaca`: `instruction`, optional `input`, `output` -> a user turn and an assistant turn.
- `sharegpt`: `conversations`, a list of `{from, value}` turns (human/gpt/system/...) -> messages.

Every non-text record becomes an `Example`: the messages of a conversation, or a plain prompt
and completion. A record that does not fit its format raises one UsageError that names the
record number (1-based, in file order) and the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from memfit.errors import UsageError

FORMATS = ("auto", "text", "prompt-completion", "messages", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names -> roles (the names its exports use in the wild).
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant", "tool": "tool",
    "function_call": "assistant", "observation": "tool", "function": "tool",
}


@dataclass(frozen=True)
class FieldNames:
    """Where each format's data sits in a record (`--messages-field`, `--prompt-field`, ...)."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"

    def identity(self) -> dict[str, str]:
        return {"text": self.text, "messages": self.messages, "prompt": self.prompt, "completion": self.completion}


@dataclass
class Example:
    """One record made uniform.

    Conversational: `messages` holds every turn and `trainable` the indices of the turns that may
    carry loss (every assistant turn; for prompt-completion, the completion's turns).
    Plain prompt-completion: `prompt` and `completion` strings, `messages` empty.
    """

    messages: list[dict[str, Any]]
    trainable: list[int]
    prompt: str = ""
    completion: str = ""

    @property
    def conversational(self) -> bool:
        return bool(self.messages)


def detect_format(record: Any, fields: FieldNames, label: str) -> str:
    """The format of a dataset from its first record; UsageError if no known set of fields is there."""
    if not isinstance(record, dict):
        raise UsageError(f"{label} record 1 is a {type(record).__name__}, not an object with fields; give one object per record")
    if fields.messages in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if fields.prompt in record and fields.completion in record:
        return "prompt-completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if fields.text in record:
        return "text"
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise UsageError(
        f"{label} record 1 has none of the fields memfit reads (it has: {keys}); name yours with --text-field,"
        f" --messages-field, or --prompt-field and --completion-field, or pass --dataset-format"
    )


def to_example(record: Any, fmt: str, number: int, fields: FieldNames, label: str) -> Example:
    """Record `number` (1-based) of format `fmt` as an Example; UsageError naming the record and field."""
    where = f"{label} record {number}"
    if not isinstance(record, dict):
        raise UsageError(f"{where} is a {type(record).__name__}, not an object with fields; give one object per record")
    if fmt == "messages":
        messages = _messages(_field(record, fields.messages, where, "--messages-field"), where, fields.messages)
        return _conversation(messages, where, fields.messages)
    if fmt == "sharegpt":
        turns = _field(record, "conversations", where, "--dataset-format")
        return _conversation(_sharegpt(turns, where), where, "conversations")
    if fmt == "alpaca":
        instruction = _string(record, "instruction", where)
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise UsageError(f"{where}: field 'input' must be a string, got {type(extra).__name__}")
        output = _string(record, "output", where)
        user = instruction if not extra.strip() else f"{instruction}\n\n{extra}"
        messages = []
        if isinstance(record.get("system"), str) and record["system"].strip():
            messages.append({"role": "system", "content": record["system"]})
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return _conversation(messages, where, "output")
    if fmt == "prompt-completion":
        prompt = _field(record, fields.prompt, where, "--prompt-field")
        completion = _field(record, fields.completion, where, "--completion-field")
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise UsageError(f"{where}: field {fields.completion!r} is empty; every record needs a completion to train on")
            return Example(messages=[], trainable=[], prompt=prompt, completion=completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            head = _messages(prompt, where, fields.prompt)
            tail = _messages(completion, where, fields.completion)
            if not any(m["role"] == "assistant" for m in tail):
                raise UsageError(f"{where}: field {fields.completion!r} has no assistant turn; the completion is what trains")
            messages = head + tail
            trainable = [len(head) + i for i, m in enumerate(tail) if m["role"] == "assistant"]
            return Example(messages=messages, trainable=trainable)
        raise UsageError(
            f"{where}: fields {fields.prompt!r} and {fields.completion!r} must both be strings or both lists of messages,"
            f" got {type(prompt).__name__} and {type(completion).__name__}"
        )
    raise ValueError(f"not a conversational format: {fmt}")


def _field(record: dict, name: str, where: str, flag: str) -> Any:
    if name not in record or record[name] is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise UsageError(f"{where} has no field {name!r} (it has: {keys}); fix the record or pass {flag} NAME")
    return record[name]


def _string(record: dict, name: str, where: str) -> str:
    value = _field(record, name, where, "--dataset-format")
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: field {name!r} must be a non-empty string")
    return value


def _messages(turns: Any, where: str, name: str) -> list[dict[str, Any]]:
    """A list of {role, content} turns, checked; extra keys (tool calls, names) are kept for the template."""
    if not isinstance(turns, Iterable) or isinstance(turns, (str, bytes, dict)):
        raise UsageError(f"{where}: field {name!r} must be a list of {{role, content}} turns, got {type(turns).__name__}")
    checked = []
    for position, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or "role" not in turn:
            raise UsageError(f"{where}: field {name!r} turn {position} has no 'role'; each turn is {{role, content}}")
        role = turn["role"]
        if role not in ROLES:
            raise UsageError(
                f"{where}: field {name!r} turn {position} has unknown role {role!r}; use one of {', '.join(ROLES)}"
            )
        content = turn.get("content")
        if content is None and not turn.get("tool_calls"):
            raise UsageError(f"{where}: field {name!r} turn {position} ({role}) has no 'content'")
        checked.append({key: value for key, value in turn.items() if value is not None})
    if not checked:
        raise UsageError(f"{where}: field {name!r} is an empty list of turns")
    return checked


def _sharegpt(turns: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise UsageError(f"{where}: field 'conversations' must be a list of {{from, value}} turns, got {type(turns).__name__}")
    messages = []
    for position, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise UsageError(f"{where}: field 'conversations' turn {position} needs 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise UsageError(
                f"{where}: field 'conversations' turn {position} has unknown speaker {turn['from']!r};"
                f" use one of {', '.join(sorted(SHAREGPT_ROLES))}"
            )
        if not isinstance(turn["value"], str):
            raise UsageError(f"{where}: field 'conversations' turn {position} 'value' must be a string")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _conversation(messages: list[dict[str, Any]], where: str, name: str) -> Example:
    trainable = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not trainable:
        raise UsageError(f"{where}: field {name!r} has no assistant turn, so nothing in it would be trained; add one or drop the record")
    return Example(messages=messages, trainable=trainable)

"""Preference records (DPO, SimPO, ORPO, KTO): the formats TRL reads, recognised from the fields of the first record.

- `preference`: `prompt` (`--prompt-field`), `chosen`, `rejected`: an explicit prompt and two answers to it.
- `implicit-preference`: only `chosen` and `rejected`, two whole conversations (or texts) that share their start:
  the shared start is the prompt (`split_implicit_prompt`).
- `unpaired-preference`: `prompt`, `completion` (`--completion-field`), `label`: one answer, desirable when the
  label is true (KTO's data; 1 and 0 count as true and false).

Every record must have the same fields and kinds of values as the first, or one UsageError names the record and
the field. memfit.data.preferences explains the whole path from records to the dataset a task trains on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.data.formats import ROLES, FieldNames
from memfit.data.records import first_record, iter_records
from memfit.data.sources import TextSource
from memfit.errors import UsageError

logger = logging.getLogger(__name__)


PREFERENCE_FORMATS = ("preference", "implicit-preference", "unpaired-preference")
PAIRED_TASKS = ("dpo", "simpo", "orpo")
"""Objectives that compare a chosen and a rejected completion of one prompt."""
UNPAIRED_TASKS = ("kto",)
"""Objectives that score each completion on its own, against a desirable/undesirable label."""
PREFERENCE_TASKS = PAIRED_TASKS + UNPAIRED_TASKS
TRL_DEFAULT_MAX_LENGTH = 1024
"""TRL's DPOConfig/KTOConfig `max_length` default; memfit takes the length from the data instead (module docstring)."""
UNPAIR_BATCH = 1000
"""TRL unpairs pairs for KTO with a batched `datasets.map` of this many records (its default batch size): each
batch's chosen completions come first, then its rejected ones. memfit keeps that order so both read the same items."""

Conversation = list[dict[str, Any]]
Value = str | Conversation



# -- records --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairRecord:
    """One preference record made uniform: a prompt and a chosen and a rejected completion, all text or all turns."""

    number: int
    """1-based, in file order."""
    prompt: Value
    chosen: Value
    rejected: Value
    tools: list | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class UnpairedRecord:
    """One completion of a prompt with its label (true: desirable), all text or all turns."""

    number: int
    prompt: Value
    completion: Value
    label: bool
    tools: list | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def detect_preference_format(record: Any, fields: FieldNames | None = None) -> str | None:
    """The preference format of a record from its fields (`fields`: the prompt and completion names, default
    `prompt` and `completion`), or None when it is none of them."""
    fields = fields or FieldNames()
    if not isinstance(record, dict):
        return None
    if "chosen" in record and "rejected" in record:
        return "preference" if fields.prompt in record else "implicit-preference"
    if fields.prompt in record and fields.completion in record and "label" in record:
        return "unpaired-preference"
    return None


def resolve_preference_format(source: TextSource, requested: str, fields: FieldNames) -> str:
    """The preference format of `source`: `requested` when it is one, else recognised from the first record."""
    if requested in PREFERENCE_FORMATS:
        return requested
    if requested != "auto":
        raise UsageError(f"--dataset-format {requested} is a supervised format; preference data is recognised from its"
                         f" fields ({', '.join(PREFERENCE_FORMATS)}): drop --dataset-format")
    if source.kind == "txt":
        raise UsageError(f"preference data needs records: give a .jsonl, .parquet or hf: dataset, not {source.label}")
    record = first_record(source)
    if record is None:
        raise UsageError(f"{source.label} holds no records; give a dataset with at least one")
    fmt = detect_preference_format(record, fields)
    if fmt is None:
        keys = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
        raise UsageError(
            f"{source.label} record 1 is not preference data (it has: {keys or 'none'}); give {fields.prompt}/chosen/"
            f"rejected, chosen/rejected, or {fields.prompt}/{fields.completion}/label records (docs/preference.md)"
        )
    return fmt


def to_preference_record(record: Any, fmt: str, number: int, fields: FieldNames, label: str
                         ) -> PairRecord | UnpairedRecord:
    """Record `number` (1-based) of format `fmt`, checked; UsageError naming the record and the field."""
    where = f"{label} record {number}"
    if not isinstance(record, dict):
        raise UsageError(f"{where} is a {type(record).__name__}, not an object with fields; give one object per record")
    tools, template_kwargs = _template_extras(record, where)
    if fmt == "unpaired-preference":
        prompt, completion = _values(record, (fields.prompt, fields.completion), where)
        return UnpairedRecord(number, prompt, completion, _label(record, where), tools, template_kwargs)
    if fmt == "preference":
        prompt, chosen, rejected = _values(record, (fields.prompt, "chosen", "rejected"), where)
    elif fmt == "implicit-preference":
        chosen, rejected = _values(record, ("chosen", "rejected"), where)
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt:
            raise UsageError(f"{where}: 'chosen' and 'rejected' share no start to take as the prompt; give the prompt"
                             f" in a {fields.prompt!r} field")
    else:
        raise ValueError(f"not a preference format: {fmt}")
    return PairRecord(number, prompt, chosen, rejected, tools, template_kwargs)


def split_implicit_prompt(chosen: Value, rejected: Value) -> tuple[Value, Value, Value]:
    """(prompt, chosen, rejected) of an implicit-prompt pair, the way TRL's `extract_prompt` splits it.

    The prompt is the start (turns, or characters) the two share, up to the first position where they differ; for
    text, a space just before that position goes to the completions. When one is a prefix of the other, the last
    shared turn or character goes to the completions too, so neither is left empty.
    """
    shortest = min(len(chosen), len(rejected))
    split = shortest - 1  # no difference found: TRL's loop ends on its last index
    for index in range(shortest):
        if chosen[index] != rejected[index]:
            # Only text can hold a space; index 0 has no character before it (TRL would read the last one).
            split = index - 1 if index > 0 and chosen[index - 1] == " " else index
            break
    return chosen[: max(split, 0)], chosen[max(split, 0):], rejected[max(split, 0):]


def read_preference_records(source: TextSource, fmt: str, fields: FieldNames, task: str
                            ) -> list[PairRecord] | list[UnpairedRecord]:
    """Every record of `source` for objective `task`: pairs for dpo/simpo/orpo; unpaired completions for kto (pairs
    unpaired in TRL's order). UsageError for a bad record, mixed text and turns, or unpaired data for a paired task."""
    if task not in PREFERENCE_TASKS:
        raise ValueError(f"not a preference task: {task}")
    if fmt == "unpaired-preference" and task in PAIRED_TASKS:
        raise UsageError(f"--task {task} compares a chosen and a rejected answer, but {source.label} holds unpaired"
                         f" completions ({fields.prompt}/{fields.completion}/label); use --task kto, or give pairs")
    records = []
    for number, raw in enumerate(iter_records(source), start=1):
        record = to_preference_record(raw, fmt, number, fields, source.label)
        if records and record.conversational != records[0].conversational:
            kinds = ("lists of turns", "text")
            raise UsageError(f"{source.label} record {number} holds {kinds[records[0].conversational]}, record 1"
                             f" {kinds[not records[0].conversational]}; give every record the same kind")
        records.append(record)
    if not records:
        raise UsageError(f"{source.label} holds no records; give a dataset with at least one")
    if task in UNPAIRED_TASKS and fmt != "unpaired-preference":
        return unpair(records)
    return records


def unpair(pairs: Sequence[PairRecord]) -> list[UnpairedRecord]:
    """Each pair as two unpaired completions (chosen: desirable), in TRL's order (UNPAIR_BATCH)."""
    unpaired = []
    for start in range(0, len(pairs), UNPAIR_BATCH):
        batch = pairs[start : start + UNPAIR_BATCH]
        for desirable in (True, False):
            unpaired += [UnpairedRecord(p.number, p.prompt, p.chosen if desirable else p.rejected, desirable, p.tools,
                                        p.template_kwargs) for p in batch]
    return unpaired


def _values(record: dict, names: tuple[str, ...], where: str) -> list[Value]:
    """The named fields, all strings or all lists of turns (turns checked, None-valued keys dropped)."""
    values = []
    for name in names:
        if record.get(name) is None:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise UsageError(f"{where} has no field {name!r} (it has: {keys}); every record needs {', '.join(names)}")
        values.append(record[name])
    if all(isinstance(value, str) for value in values):
        return values
    if all(isinstance(value, list) for value in values):
        return [_turns(value, where, name) for value, name in zip(values, names, strict=True)]
    kinds = ", ".join(f"{name!r} a {type(value).__name__}" for name, value in zip(names, values, strict=True))
    raise UsageError(f"{where}: fields {', '.join(map(repr, names))} must all be strings or all lists of"
                     f" {{role, content}} turns, got {kinds}")


def _turns(turns: list, where: str, name: str) -> Conversation:
    checked = []
    for position, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or "role" not in turn:
            raise UsageError(f"{where}: field {name!r} turn {position} has no 'role'; each turn is {{role, content}}")
        if turn["role"] not in ROLES:
            raise UsageError(f"{where}: field {name!r} turn {position} has unknown role {turn['role']!r};"
                             f" use one of {', '.join(ROLES)}")
        if turn.get("content") is None and not turn.get("tool_calls"):
            raise UsageError(f"{where}: field {name!r} turn {position} ({turn['role']}) has no 'content'")
        # Keys without a value are dropped: apply_chat_template drops them too, and columnar files fill them in.
        checked.append({key: value for key, value in turn.items() if value is not None})
    if not checked:
        raise UsageError(f"{where}: field {name!r} is an empty list of turns")
    return checked


def _label(record: dict, where: str) -> bool:
    label = record.get("label")
    if isinstance(label, bool):
        return label
    if isinstance(label, int) and label in (0, 1):
        return bool(label)
    raise UsageError(f"{where}: field 'label' must be true (a desirable completion) or false, got {label!r}")


def _template_extras(record: dict, where: str) -> tuple[list | None, dict[str, Any]]:
    """The record's `tools` (a JSON string is read) and `chat_template_kwargs`, which TRL passes to the template."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where}: field 'tools' is a string that is not JSON ({error.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise UsageError(f"{where}: field 'tools' must be a list of tool definitions, got {type(tools).__name__}")
    extras = record.get("chat_template_kwargs") or {}
    if not isinstance(extras, dict):
        raise UsageError(f"{where}: field 'chat_template_kwargs' must be an object, got {type(extras).__name__}")
    return tools, extras

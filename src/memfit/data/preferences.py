"""Preference data (DPO, SimPO, ORPO, KTO): records -> token ids of prompts and completions, as TRL tokenizes them.

Formats (recognised from the fields of the first record, as formats.py recognises the supervised ones; every
record must then have the same fields and kinds of values, or one UsageError names the record and the field):

- `preference`: `prompt` (`--prompt-field`), `chosen`, `rejected`: an explicit prompt and two answers to it.
- `implicit-preference`: only `chosen` and `rejected`, two whole conversations (or texts) that share their start:
  the shared start is the prompt (`split_implicit_prompt`).
- `unpaired-preference`: `prompt`, `completion` (`--completion-field`), `label`: one answer, desirable when the
  label is true (KTO's data; 1 and 0 count as true and false).

Each is conversational (every value a list of `{role, content}` turns) or plain text (every value a string). A
record may carry `tools` (a list, or that list as a JSON string) and `chat_template_kwargs` (an object); both go to
the chat template. JSONL, Parquet and `hf:` datasets are read (records.py); `builtin:preferences` is a small set of
conversational pairs shipped with memfit.

Tokens (TRL 1.16's DPOTrainer and KTOTrainer data preparation, reimplemented here, checked against TRL's in tests):

- conversational: the prompt is rendered with the generation prompt (`add_generation_prompt=True`), and the prompt
  followed by each completion without it, both by the tokenizer's `apply_chat_template` (the tokenizer's template,
  or `--chat-template`), the rendered text tokenized without adding special tokens;
- plain text: each completion gets the tokenizer's EOS token (as text, unless it ends with it already); the prompt,
  prompt + chosen and prompt + rejected are tokenized as text, special tokens added (a BOS where the tokenizer adds
  one);
- the prompt's tokens are the common start of the tokenized prompt and of every tokenized prompt + completion,
  and each completion's tokens are the rest of its sequence. A template that renders the prompt alone differently
  (or a token merging across the boundary) shortens the prompt to where they agree; how many records did so is
  counted (`prompt_boundary_mismatches`) and said once;
- KTO (`task="kto"`) reads pairs as two unpaired completions, the chosen one desirable, in TRL's order: per run of
  UNPAIR_BATCH records, the chosen completions, then the rejected ones.

Length (`--seq-len` plays TRL's `max_length`; without it the length comes from the data, as lengths.py chooses it
for whole samples, over the pair lengths): a pair's length is its longer sequence, max(prompt + chosen, prompt +
rejected). A pair longer than the length is dropped, or with `--truncate` cut as TRL cuts (`keep_start`: each
sequence keeps its first `seq_len` tokens, the prompt whole); a pair whose prompt alone fills the length has nothing
left to score and is dropped in both cases (TRL drops it too). Dropping more than 1% of the pairs or of the scored
tokens stops the run unless `--allow-drop` (lengths.check_length_loss).

Interface for the training task:

    dataset = load_preference_data(data_cfg, tokenizer, task="dpo", max_positions=..., min_samples=...)
    len(dataset)                # pairs (dpo, simpo, orpo) or completions (kto) kept by the length policy
    dataset[i]                  # PreferencePair(prompt_ids, chosen_ids, rejected_ids, record), cut to seq_len,
                                # or UnpairedCompletion(prompt_ids, completion_ids, label, record) for kto
    dataset.paired              # which of the two `dataset[i]` is
    dataset.seq_len             # the longest sequence of any item, what a batch row holds
    dataset.lengths             # each kept item's longest sequence (after any cut), for planning and grouping
    dataset.whole(j)            # item j of every item read (kept or not), never cut
    dataset.segment_lengths     # (items, 3) prompt/chosen/rejected or (items, 2) prompt/completion token counts
    dataset.length_distribution()   # LengthDistribution of the pair lengths: median, p99, max, mean
    dataset.cost_at(max_length)     # LengthCost: how many items a length keeps whole, cuts, drops
    dataset.policy              # lengths.LengthPolicy: what --seq-len / --truncate did ("samples" are items)
    dataset.description, dataset.data_facts()   # one line for the log; a dict for the metrics and the report

Scored tokens are the completions' tokens (every one is predicted from the token before it: the prompt's last, or
the completion's own). `preference_report` and `describe_preference_data` are what `memfit data --task dpo` shows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from memfit.data.formats import ROLES, FieldNames
from memfit.data.lengths import LengthPolicy, check_length_loss, start_policy
from memfit.data.records import first_record, iter_records, resolve
from memfit.data.samples import BUILTIN_TOKENIZER_TEMPLATE, BYTE_TOKENIZER_FINGERPRINT
from memfit.data.sources import TextSource
from memfit.data.templates import resolve_chat_template
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


# -- tokens ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferencePair:
    """A pair as the model reads it: the prompt's tokens, then either completion's. The completions are scored."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    record: int = 0
    """The record it came from (1-based), for messages."""

    @property
    def length(self) -> int:
        """Tokens of the longer sequence, max(prompt + chosen, prompt + rejected): what a batch row must hold."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))

    @property
    def scored_tokens(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)

    def chosen_input_ids(self) -> list[int]:
        return self.prompt_ids + self.chosen_ids

    def rejected_input_ids(self) -> list[int]:
        return self.prompt_ids + self.rejected_ids

    def cut(self, max_length: int) -> PreferencePair:
        """Each sequence cut to its first `max_length` tokens (TRL's keep_start); the prompt must be shorter."""
        room = max_length - len(self.prompt_ids)
        if room <= 0:
            raise ValueError(f"a prompt of {len(self.prompt_ids)} tokens leaves nothing of the completions in {max_length}")
        return PreferencePair(self.prompt_ids, self.chosen_ids[:room], self.rejected_ids[:room], self.record)


@dataclass(frozen=True)
class UnpairedCompletion:
    """A completion as the model reads it (prompt, then completion, the completion scored) and its label."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    """True: a desirable completion."""
    record: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def scored_tokens(self) -> int:
        return len(self.completion_ids)

    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def cut(self, max_length: int) -> UnpairedCompletion:
        """The sequence cut to its first `max_length` tokens; the prompt must be shorter."""
        room = max_length - len(self.prompt_ids)
        if room <= 0:
            raise ValueError(f"a prompt of {len(self.prompt_ids)} tokens leaves nothing of the completion in {max_length}")
        return UnpairedCompletion(self.prompt_ids, self.completion_ids[:room], self.label, self.record)


class PreferenceTokenizer:
    """Records -> token ids, the way TRL's DPOTrainer and KTOTrainer prepare them (module docstring).

    `template`: the Jinja text of `--chat-template`, or None for the tokenizer's own (chosen by transformers as TRL
    has it chosen, a tool-use template included). Counts the records whose tokenized prompt is not a prefix of
    their tokenized prompt + completion (`prompt_boundary_mismatches`).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, label: str = "the data") -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.label = label
        self.prompt_boundary_mismatches = 0
        self.first_mismatch: str | None = None
        """The prompt's tokens left out of the first record that had some, decoded (said once, as TRL says it)."""

    def pair(self, record: PairRecord) -> PreferencePair:
        prompt, chosen, rejected = self._split(record, [record.chosen, record.rejected])
        return PreferencePair(prompt, chosen, rejected, record.number)

    def unpaired(self, record: UnpairedRecord) -> UnpairedCompletion:
        prompt, completion = self._split(record, [record.completion])
        return UnpairedCompletion(prompt, completion, record.label, record.number)

    def _split(self, record: PairRecord | UnpairedRecord, completions: list[Value]) -> list[list[int]]:
        """[prompt ids, then each completion's ids]: the common start of the tokenized prompt and of every tokenized
        prompt + completion is the prompt, the rest of each sequence its completion."""
        if record.conversational:
            prompt_ids = self._render(record, record.prompt, generation_prompt=True)
            sequences = [self._render(record, record.prompt + completion, generation_prompt=False)
                         for completion in completions]
        else:
            eos = self._eos()
            prompt_ids = self._text(record.prompt)
            sequences = [self._text(record.prompt + (text if text.endswith(eos) else text + eos))
                         for text in completions]
        shared = min(_common_prefix(prompt_ids, sequence) for sequence in sequences)
        if shared < len(prompt_ids):
            self.prompt_boundary_mismatches += 1
            if self.first_mismatch is None:
                self.first_mismatch = self.tokenizer.decode(prompt_ids[shared:])
        for sequence in sequences:
            if len(sequence) == shared:
                raise UsageError(f"{self.label} record {record.number}: a completion has no tokens of its own after"
                                 " the prompt, so nothing of it would be scored; fix the record or drop it")
        return [prompt_ids[:shared]] + [sequence[shared:] for sequence in sequences]

    def _render(self, record: PairRecord | UnpairedRecord, turns: Conversation, generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tools=record.tools, add_generation_prompt=generation_prompt,
                tokenize=False, **record.template_kwargs)
        except Exception as error:  # jinja2 errors and the template's own raise_exception()
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"{self.label} record {record.number}: the chat template failed ({first}); check the"
                             " template or the record") from None
        # apply_chat_template(tokenize=True) tokenizes the rendered text so: the template wrote the special tokens.
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, verbose=False)["input_ids"])

    def _eos(self) -> str:
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos:
            raise UsageError("plain-text preference data ends each completion with the tokenizer's EOS token, and this"
                             " tokenizer has none; use a tokenizer with one, or conversational records")
        return eos


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


# -- the dataset ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts of items (pairs: the longer of their two sequences): median, p99, max, mean."""

    count: int
    median: int
    p99: int
    max: int
    mean: float

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthDistribution:
        lengths = np.asarray(lengths, dtype=np.int64)
        if not len(lengths):
            return cls(0, 0, 0, 0, 0.0)
        # "higher": a length that occurs in the data, as `memfit data` reports every percentile.
        return cls(len(lengths), int(np.percentile(lengths, 50, method="higher")),
                   int(np.percentile(lengths, 99, method="higher")), int(lengths.max()), round(float(lengths.mean()), 1))

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "median": self.median, "p99": self.p99, "max": self.max, "mean": self.mean}


@dataclass(frozen=True)
class LengthCost:
    """What a max length does to the items when they are cut as TRL cuts them (keep_start)."""

    max_length: int
    whole: int
    """Items that fit as they are."""
    cut: int
    """Items longer than the length whose prompt is shorter: their completions lose their ends."""
    dropped: int
    """Items whose prompt alone fills the length: nothing left to score (TRL drops them)."""
    scored_tokens_lost: int
    """Completion tokens cut off or dropped."""

    def as_dict(self) -> dict[str, int]:
        return {"max_length": self.max_length, "whole": self.whole, "cut": self.cut, "dropped": self.dropped,
                "scored_tokens_lost": self.scored_tokens_lost}


class PreferenceDataset:
    """Tokenized preference items, kept (and, with --truncate, cut) by the length policy; see the module docstring.

    The tokens of every item read are kept whole, back to back in one array; `dataset[i]` builds the i-th kept item,
    cut to `seq_len` where the policy cuts, and `whole(j)` any item read as it was tokenized.
    """

    def __init__(self, items: Sequence[PreferencePair] | Sequence[UnpairedCompletion], policy: LengthPolicy, *,
                 fmt: str, task: str, source: str, records: int, conversational: bool, template_name: str | None,
                 prompt_boundary_mismatches: int = 0) -> None:
        self.paired = task in PAIRED_TASKS
        self.segment_names: tuple[str, ...] = ("prompt", "chosen", "rejected") if self.paired else ("prompt", "completion")
        segments = [_segments(item) for item in items]
        self.segment_lengths = np.asarray([[len(s) for s in item] for item in segments], dtype=np.int64).reshape(
            len(segments), len(self.segment_names))
        self._offsets = np.concatenate([[0], np.cumsum(self.segment_lengths.reshape(-1))]).astype(np.int64)
        self._tokens = np.fromiter(chain.from_iterable(chain.from_iterable(segments)), dtype=np.int64,
                                   count=int(self._offsets[-1]))
        self._records = np.asarray([item.record for item in items], dtype=np.int64)
        self._labels = None if self.paired else np.asarray([item.label for item in items], dtype=np.bool_)
        self.policy = policy
        self.seq_len = policy.seq_len
        self.lengths = policy.lengths
        self.format = fmt
        self.task = task
        self.source = source
        self.records = records
        self.conversational = conversational
        self.template_name = template_name
        self.prompt_boundary_mismatches = prompt_boundary_mismatches
        self.stride = 0
        self.packing = "off"  # a pair is two rows that share a prompt: never packed with other samples
        self.preference = True

    # -- items ------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.policy.kept)

    def __getitem__(self, index: int) -> PreferencePair | UnpairedCompletion:
        if not -len(self) <= index < len(self):
            raise IndexError(f"item {index} is out of range for {len(self)} items")
        item = self.whole(int(self.policy.kept[int(index) % len(self)]))
        return item.cut(self.seq_len) if item.length > self.seq_len else item

    def __iter__(self) -> Iterator[PreferencePair | UnpairedCompletion]:
        for index in range(len(self)):
            yield self[index]

    def whole(self, index: int) -> PreferencePair | UnpairedCompletion:
        """Item `index` of every item read (kept or not), as tokenized."""
        base = index * len(self.segment_names)
        parts = [self._tokens[self._offsets[base + k] : self._offsets[base + k + 1]].tolist()
                 for k in range(len(self.segment_names))]
        record = int(self._records[index])
        if self.paired:
            return PreferencePair(parts[0], parts[1], parts[2], record)
        assert self._labels is not None
        return UnpairedCompletion(parts[0], parts[1], bool(self._labels[index]), record)

    @property
    def num_items(self) -> int:
        """Items read (pairs, or completions for kto), kept or not."""
        return len(self.segment_lengths)

    # -- lengths ------------------------------------------------------------------------------------------------

    @property
    def item_lengths(self) -> np.ndarray:
        """Each item's longest sequence as tokenized (every item read): prompt + the longer completion."""
        return self.segment_lengths[:, 0] + self.segment_lengths[:, 1:].max(axis=1)

    def length_distribution(self) -> LengthDistribution:
        """The pair lengths (each pair's longer sequence; a completion's sequence for kto) of every item read."""
        return LengthDistribution.of(self.item_lengths)

    def cost_at(self, max_length: int) -> LengthCost:
        """How many items `max_length` keeps whole, cuts (TRL's keep_start) and drops (prompt fills it)."""
        prompts, completions = self.segment_lengths[:, 0], self.segment_lengths[:, 1:]
        dropped = prompts >= max_length
        cut = ~dropped & (self.item_lengths > max_length)
        room = np.maximum(max_length - prompts, 0)[:, None]
        lost = int((completions - np.minimum(completions, room)).sum())
        return LengthCost(max_length, int((~dropped & ~cut).sum()), int(cut.sum()), int(dropped.sum()), lost)

    # -- counts and words ---------------------------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        """Records in the source."""
        return self.records

    @property
    def num_tokens(self) -> int:
        """Tokens of the rows the model runs over the kept items: a pair's prompt counts twice (one row per
        completion), the cut ends not at all."""
        kept = self.policy.kept
        prompts = self.segment_lengths[kept, 0]
        rows = self.segment_lengths.shape[1] - 1
        return int(prompts.sum() * rows + self.policy.targets.sum())

    @property
    def num_target_tokens(self) -> int:
        """Completion tokens scored over the kept items (after any cut)."""
        return int(self.policy.targets.sum())

    @property
    def desirable(self) -> int | None:
        """Kept completions labelled desirable (kto); None for pairs."""
        return None if self._labels is None else int(self._labels[self.policy.kept].sum())

    def data_facts(self) -> dict[str, Any]:
        """What the data is and what the length policy cost (metrics and report); policy counts are of items."""
        facts = {"format": self.format, "task": self.task, "conversational": self.conversational,
                 "chat_template": self.template_name, "records": self.records, "items": self.num_items,
                 "paired": self.paired, "tokens": self.num_tokens, "target_tokens": self.num_target_tokens,
                 "train_on": "completions", "prompt_boundary_mismatches": self.prompt_boundary_mismatches,
                 "item_lengths": self.length_distribution().as_dict(), **self.policy.facts()}
        if not self.paired:
            facts["desirable"] = self.desirable
            facts["undesirable"] = len(self) - int(self.desirable or 0)
        return facts

    @property
    def description(self) -> str:
        """One line for the user: source, format, items of at most seq_len tokens, scored share."""
        kind = "conversational" if self.conversational else "text"
        template = f", template {self.template_name}" if self.template_name else ""
        noun = "pairs" if self.paired else "completions"
        kept = f"{len(self):,} of {self.num_items:,} {noun}" if len(self) != self.num_items else f"{len(self):,} {noun}"
        share = self.num_target_tokens / max(1, self.num_tokens)
        labels = ""
        if not self.paired:
            labels = f" ({self.desirable:,} desirable, {len(self) - int(self.desirable or 0):,} undesirable)"
        return (f"{self.source}: {self.records:,} records ({self.format}, {kind}{template}), {kept}{labels} of <="
                f" {self.seq_len} tokens a sequence, {self.num_tokens:,} tokens, {share:.0%} scored (the completions)")


def _segments(item: PreferencePair | UnpairedCompletion) -> list[list[int]]:
    if isinstance(item, PreferencePair):
        return [item.prompt_ids, item.chosen_ids, item.rejected_ids]
    return [item.prompt_ids, item.completion_ids]


def apply_preference_policy(segment_lengths: np.ndarray, seq_len: int | None, truncate: bool,
                            max_positions: int | None = None) -> LengthPolicy:
    """Which items a length keeps (module docstring), as a LengthPolicy whose samples are items and whose target
    tokens are completion tokens. `seq_len` None: from the data (lengths.seq_len_from_data over the item lengths)."""
    segment_lengths = np.asarray(segment_lengths, dtype=np.int64)
    prompts, completions = segment_lengths[:, 0], segment_lengths[:, 1:]
    lengths = prompts + completions.max(axis=1)
    targets = completions.sum(axis=1)
    policy = start_policy(lengths, targets, seq_len, truncate, max_positions)
    limit = policy.seq_len
    long = lengths > limit
    if truncate:
        room = np.maximum(limit - prompts, 0)[:, None]
        left = np.minimum(completions, room).sum(axis=1)
        fills = prompts >= limit  # nothing of the completions fits beside the prompt
        policy.truncated = int((long & ~fills).sum())
        policy.dropped_no_target = int(fills.sum())
        policy.target_tokens_lost = int((targets - left).sum())
        keep = ~fills
        kept_targets = left
    else:
        policy.dropped_long = int(long.sum())
        policy.target_tokens_lost = int(targets[long].sum())
        keep = ~long
        kept_targets = targets
    policy.kept = np.flatnonzero(keep).astype(np.int64)
    policy.lengths = np.minimum(lengths, limit)[keep].astype(np.int64)
    policy.targets = kept_targets[keep].astype(np.int64)
    return policy


def length_lines(dataset: PreferenceDataset) -> list[str]:
    """What the length did to the items, one short line each (chosen from the data, dropped, cut)."""
    policy, noun = dataset.policy, ("pairs" if dataset.paired else "completions")
    lines = []
    if policy.from_data:  # lengths.py words it for samples and target tokens: here they are items and scored tokens
        lines.append(policy.from_data.describe().replace("sample", noun[:-1]).replace("target tokens", "scored tokens"))
    scored = f"{policy.target_tokens_lost:,} of {policy.target_tokens:,} scored tokens"
    if policy.truncated:
        lines.append(f"--truncate: {policy.truncated:,} of {policy.samples:,} {noun} of {dataset.source} cut to their"
                     f" first {policy.seq_len} tokens a sequence (prompt kept whole), {scored} cut off")
    if policy.dropped_long:
        keep = policy.seq_len_keeping_all
        which = f"seq-len {policy.seq_len} (from the data)" if policy.from_data else f"--seq-len {policy.seq_len}"
        lines.append(f"{which} drops {policy.dropped_long:,} of {policy.samples:,} {noun} of"
                     f" {dataset.source} (longer than {policy.seq_len} tokens) and {scored}"
                     + (f"; --seq-len {keep} keeps them, --truncate cuts them" if keep else "; --truncate cuts them"))
    if policy.dropped_no_target:
        dropped = noun if policy.dropped_no_target != 1 else noun[:-1]
        lines.append(f"{policy.dropped_no_target:,} {dropped} of {dataset.source} dropped: the prompt alone fills"
                     f" {policy.seq_len} tokens, nothing of the completions would be scored")
    return lines


# -- loading -------------------------------------------------------------------------------------------------------


def load_preference_data(data_cfg: Any, tokenizer: Any, *, task: str = "dpo", max_positions: int | None = None,
                         min_samples: int = 1, rope_positions: int | None = None, say: bool = True
                         ) -> PreferenceDataset:
    """The tokenized preference items of `data_cfg.dataset` for objective `task`, the length policy applied.

    Reads data_cfg's dataset, dataset_format (`auto` or one of PREFERENCE_FORMATS), prompt_field,
    completion_field, chat_template, seq_len, truncate and allow_drop. Tokenized in memory on each load (no cache).
    `say`: log what the length did and a prompt the template renders differently alone, one line each.
    Raises UsageError for a bad record, a missing chat template, a length the model cannot hold, one that drops
    more than 1% (without allow_drop), or fewer than `min_samples` items left.
    """
    from memfit.data import check_seq_len

    if data_cfg.seq_len is not None:
        check_seq_len(data_cfg.seq_len, 0, max_positions, rope_positions)
    fields = FieldNames(text=data_cfg.text_field, messages=data_cfg.messages_field, prompt=data_cfg.prompt_field,
                        completion=data_cfg.completion_field)
    source = resolve(data_cfg.dataset, data_cfg.text_field)
    fmt = resolve_preference_format(source, data_cfg.dataset_format, fields)
    records = read_preference_records(source, fmt, fields, task)
    conversational = records[0].conversational
    template, template_name = _template(data_cfg, tokenizer) if conversational else (None, None)
    tokenize = PreferenceTokenizer(tokenizer, template, source.label)
    items = [tokenize.pair(r) if isinstance(r, PairRecord) else tokenize.unpaired(r) for r in records]
    segments = np.asarray([[len(s) for s in _segments(item)] for item in items], dtype=np.int64)
    policy = apply_preference_policy(segments, data_cfg.seq_len, data_cfg.truncate, max_positions)
    if data_cfg.seq_len is None:
        check_seq_len(policy.seq_len, 0, max_positions, rope_positions)
    dataset = PreferenceDataset(items, policy, fmt=fmt, task=task, source=source.label,
                                records=len({r.number for r in records}), conversational=conversational,
                                template_name=template_name,
                                prompt_boundary_mismatches=tokenize.prompt_boundary_mismatches)
    noun = "pairs" if dataset.paired else "completions"
    if not len(dataset):
        keep = policy.seq_len_keeping_all
        raise UsageError(f"no {noun[:-1]} of {source.label} fits --seq-len {policy.seq_len} (the longest has"
                         f" {policy.longest:,} tokens); pass " + (f"--seq-len {keep}" if keep else "a longer --seq-len")
                         + (" or --truncate" if not data_cfg.truncate else ""))
    check_length_loss(policy, source.label, data_cfg.allow_drop)
    if len(dataset) < min_samples:
        raise UsageError(f"{source.label} has {len(dataset)} {noun} that fit --seq-len {policy.seq_len}, fewer than one"
                         f" effective batch ({min_samples}); lower --batch-size/--gradient-accumulation-steps or add data")
    if say:
        for number, line in enumerate(length_lines(dataset)):
            (logger.info if number == 0 and policy.from_data is not None else logger.warning)("memfit: %s", line)
        if tokenize.first_mismatch is not None:
            logger.warning("memfit: %s: in %d of %d records the tokenized prompt is not the start of the tokenized prompt"
                           " + completion (the template renders the prompt alone differently, or tokens merge across"
                           " the boundary); the prompt ends where they agree, leaving out %r", source.label,
                           tokenize.prompt_boundary_mismatches, len(records), tokenize.first_mismatch)
    return dataset


def _template(data_cfg: Any, tokenizer: Any) -> tuple[str | None, str]:
    """(the Jinja text to render with, None for the tokenizer's own; its name for the user). As samples.py: memfit's
    byte tokenizer, which has none, renders with chatml; a chosen template is set on the tokenizer so the saved
    model renders conversations the same way at inference."""
    choice = data_cfg.chat_template
    if not choice and not getattr(tokenizer, "chat_template", None) and (
            getattr(tokenizer, "fingerprint", None) == BYTE_TOKENIZER_FINGERPRINT):
        choice = BUILTIN_TOKENIZER_TEMPLATE
    template = resolve_chat_template(tokenizer, choice, getattr(tokenizer, "name_or_path", "") or "the model")
    if not choice:
        return None, "the tokenizer's"
    tokenizer.chat_template = template
    return template, choice


# -- what `memfit data --task dpo` shows -----------------------------------------------------------------------------


def preference_report(dataset: PreferenceDataset, tokenizer: Any, show: int = 3) -> dict[str, Any]:
    """What `memfit data` shows of preference data, as a JSON-ready dict: the first `show` kept items decoded from
    their tokens (prompt, then each scored completion) with their ids, the lengths of each part, the pair-length
    distribution, the scored share and what the length does."""
    lengths = dataset.segment_lengths
    parts = {name: LengthDistribution.of(lengths[:, k]).as_dict() for k, name in enumerate(dataset.segment_names)}
    shown = []
    for index in range(min(show, len(dataset))):
        item = dataset[index]
        whole = dataset.whole(int(dataset.policy.kept[index]))
        completions = ([("chosen", item.chosen_ids), ("rejected", item.rejected_ids)]
                       if isinstance(item, PreferencePair) else [("completion", item.completion_ids)])
        entry: dict[str, Any] = {
            "record": item.record, "prompt": tokenizer.decode(item.prompt_ids), "prompt_ids": item.prompt_ids,
            "completions": [{"name": name, "text": tokenizer.decode(ids), "ids": ids, "scored_tokens": len(ids)}
                            for name, ids in completions],
            "cut": item.length < whole.length,
        }
        if isinstance(item, UnpairedCompletion):
            entry["label"] = item.label
        shown.append(entry)
    policy = dataset.policy.facts()
    if dataset.policy.from_data is not None:
        policy["seq_len_choice"] = dataset.policy.from_data.describe()
    return {
        "preference": True, "dataset": dataset.source, "format": dataset.format, "task": dataset.task, "paired": dataset.paired,
        "conversational": dataset.conversational, "chat_template": dataset.template_name, "seq_len": dataset.seq_len,
        "records": dataset.records, "items": dataset.num_items, "kept": len(dataset),
        "lengths": {"item": dataset.length_distribution().as_dict(), **parts},
        "tokens": dataset.num_tokens, "scored_tokens": dataset.num_target_tokens,
        "scored_share": round(dataset.num_target_tokens / max(1, dataset.num_tokens), 4),
        "cost_at_seq_len": dataset.cost_at(dataset.seq_len).as_dict(),
        "length_policy": policy, "length_lines": length_lines(dataset),
        "prompt_boundary_mismatches": dataset.prompt_boundary_mismatches,
        "desirable": dataset.desirable, "shown": shown,
    }


def describe_preference_data(report: dict[str, Any], color: bool = False, marks: tuple[str, str] = ("[[", "]]"),
                             colors: tuple[str, str] = ("\033[1;32m", "\033[0m")) -> str:
    """`preference_report` in words: each shown item's prompt, then its completions with the scored tokens marked
    (`marks`, or `colors` on a terminal), the lengths and what the length does."""
    opened, closed = colors if color else marks
    marked = "in green" if color else f"between {marks[0]} and {marks[1]}"
    noun = "pairs" if report["paired"] else "completions"
    kind = "conversational" if report["conversational"] else "plain text"
    template = f", chat template {report['chat_template']}" if report["chat_template"] else ""
    lines = [f"{report['dataset']}: {report['records']:,} records, format {report['format']} ({kind}{template}),"
             f" {report['items']:,} {noun} for --task {report['task']}; scored: the completions' tokens"]
    for number, item in enumerate(report["shown"], start=1):
        sizes = ", ".join(f"{c['name']} {c['scored_tokens']}" for c in item["completions"])
        label = "" if "label" not in item else (", desirable" if item["label"] else ", undesirable")
        cut = f", cut to --seq-len {report['seq_len']}" if item["cut"] else ""
        lines += ["", f"--- {noun[:-1]} {number} (record {item['record']}{label}): prompt {len(item['prompt_ids'])}"
                      f" tokens, {sizes} scored (shown {marked}){cut} ---", "prompt:", item["prompt"]]
        for completion in item["completions"]:
            lines += [f"{completion['name']}:", f"{opened}{completion['text']}{closed}"]
    lengths = report["lengths"]
    whole = lengths["item"]
    what = "longer of prompt+chosen and prompt+rejected" if report["paired"] else "prompt+completion"
    lines += ["", f"{noun[:-1]} lengths (tokens, the {what}; {whole['count']:,} {noun}): median {whole['median']:,},"
                  f" p99 {whole['p99']:,}, max {whole['max']:,}, mean {whole['mean']:,}"]
    lines.append("parts (median / p99 / max): " + "; ".join(
        f"{name} {lengths[name]['median']:,} / {lengths[name]['p99']:,} / {lengths[name]['max']:,}"
        for name in lengths if name != "item"))
    lines.append(f"scored tokens: {report['scored_tokens']:,} of {report['tokens']:,} ({report['scored_share']:.1%})"
                 f" in the {report['kept']:,} {noun} kept" + ("" if not report["paired"] else ", each prompt run twice"))
    if report.get("desirable") is not None:
        lines.append(f"labels: {report['desirable']:,} desirable, {report['kept'] - report['desirable']:,} undesirable")
    cost = report["cost_at_seq_len"]
    lines += report["length_lines"] or [f"at --seq-len {report['seq_len']}: every one of the {report['items']:,}"
                                        f" {noun} fits whole (the longest has {whole['max']:,} tokens)"]
    if cost["cut"] and not report["length_policy"].get("truncate"):
        lines.append(f"cut as TRL cuts (--truncate): {cost['cut']:,} {noun} would lose the ends of their completions,"
                     f" {cost['dropped']:,} dropped")
    if report["prompt_boundary_mismatches"]:
        lines.append(f"{report['prompt_boundary_mismatches']:,} records: the tokenized prompt is not the start of the"
                     " tokenized prompt + completion; the prompt ends where they agree")
    return "\n".join(lines)

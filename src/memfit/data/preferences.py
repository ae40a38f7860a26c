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
the completion's own). What `memfit data --task dpo` shows is memfit.data.preference_view.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from memfit.data.formats import FieldNames
from memfit.data.lengths import LengthPolicy, check_length_loss, start_policy

# The records' and the tokens' names are this module's too: callers import the whole path from here.
from memfit.data.preference_records import (  # noqa: F401
    PAIRED_TASKS,
    PREFERENCE_FORMATS,
    PREFERENCE_TASKS,
    TRL_DEFAULT_MAX_LENGTH,
    UNPAIR_BATCH,
    UNPAIRED_TASKS,
    PairRecord,
    UnpairedRecord,
    detect_preference_format,
    read_preference_records,
    resolve_preference_format,
    split_implicit_prompt,
    to_preference_record,
    unpair,
)
from memfit.data.preference_tokens import PreferencePair, PreferenceTokenizer, UnpairedCompletion  # noqa: F401
from memfit.data.records import resolve
from memfit.data.samples import BUILTIN_TOKENIZER_TEMPLATE, BYTE_TOKENIZER_FINGERPRINT
from memfit.data.templates import resolve_chat_template
from memfit.errors import UsageError

logger = logging.getLogger(__name__)


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
        self.packing = "off"  # not packed as a dataset: the task packs a micro-batch's sequences (tasks/pair_packing.py)
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

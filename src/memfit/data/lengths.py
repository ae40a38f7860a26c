"""How long a sample may be: --seq-len chosen from the data, and what a length costs the data.

Formats that yield whole samples (conversations, prompt-completion, Alpaca, ShareGPT, tables, FASTA) never cut a
sample across windows: a sample longer than --seq-len is dropped, or cut to its start with --truncate. So:

- Without --seq-len the length comes from the data (`seq_len_from_data`): the longest sample, or, when a few
  outliers are far longer (over OUTLIER_RATIO times), the shortest length that keeps at least 99% of the samples
  and of the target tokens; rounded up to a multiple of SEQ_LEN_MULTIPLE and capped at the model's positions.
  Plain text is cut into windows of any length and keeps DEFAULT_SEQ_LEN.
- A length that would drop more than LOSS_LIMIT_PERCENT of the samples or of the target tokens stops the run before
  anything is written (`check_length_loss`), saying what would be lost and what to change: --seq-len N (the length
  that keeps every sample), --truncate (cut them, keeping the start) or --allow-drop (accept the loss).
- What a length did (chosen from the data, a small drop, an accepted drop, the cuts of --truncate) is said in one
  short line each (`length_lines`), apart from the long data line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit.errors import UsageError

SEQ_LEN_MULTIPLE = 64
"""A length from the data is rounded up to a multiple of this (kernels and the planner like round shapes)."""
KEEP_PERCENT = 99
"""A length from the data keeps at least this share of the samples and of the target tokens."""
OUTLIER_RATIO = 1.5
"""The longest sample sets the length unless it is this many times longer than the KEEP_PERCENT length."""
LOSS_LIMIT_PERCENT = 1
"""Dropping more than this share of the samples or of the target tokens stops the run (--allow-drop accepts it)."""


def round_up(length: int, max_positions: int | None = None) -> int:
    """`length` rounded up to a multiple of SEQ_LEN_MULTIPLE, at most `max_positions` (never below `length` unless
    the positions are fewer)."""
    rounded = -(-max(int(length), 2) // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
    return min(rounded, max_positions) if max_positions else rounded


def length_keeping(lengths: np.ndarray, targets: np.ndarray, percent: int = KEEP_PERCENT) -> int:
    """The smallest length that keeps at least `percent` % of the samples and of their target tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        return 0
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    kept_targets = np.cumsum(np.asarray(targets, dtype=np.int64)[order])
    kept_samples = np.arange(1, len(ordered) + 1)
    enough = (kept_samples * 100 >= percent * len(ordered)) & (kept_targets * 100 >= percent * kept_targets[-1])
    return int(ordered[int(np.argmax(enough))])  # the last index always qualifies


@dataclass(frozen=True)
class SeqLenChoice:
    """--seq-len as the data chose it (not given by the user)."""

    seq_len: int
    longest: int
    """Tokens of the longest sample."""
    basis: int
    """The length rounded up: the longest sample, or the KEEP_PERCENT length when outliers are far longer."""
    samples: int
    kept: int
    """Samples no longer than `seq_len`."""
    max_positions: int | None = None
    """The model's positions, when they capped the length."""

    def describe(self) -> str:
        """One line: 'seq-len 768 from the data (longest sample 731 tokens; keeps 50 of 50 samples)'."""
        capped = f", capped at the model's {self.max_positions:,} positions" if self.max_positions else ""
        basis = (f"longest sample {self.longest:,} tokens" if self.basis == self.longest else
                 f"{KEEP_PERCENT}% of samples and target tokens fit {self.basis:,} tokens, the longest has {self.longest:,}")
        return f"seq-len {self.seq_len} from the data{capped} ({basis}; keeps {self.kept:,} of {self.samples:,} samples)"


def seq_len_from_data(lengths: np.ndarray, targets: np.ndarray, max_positions: int | None = None) -> SeqLenChoice:
    """The --seq-len a run of these whole samples takes when none is given (see the module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max()) if len(lengths) else 0
    keeping = length_keeping(lengths, targets)
    basis = longest if longest <= OUTLIER_RATIO * keeping else keeping
    seq_len = round_up(basis, max_positions)
    capped = max_positions if max_positions and seq_len < round_up(basis) else None
    return SeqLenChoice(seq_len, longest, basis, len(lengths), int((lengths <= seq_len).sum()), capped)


@dataclass
class LengthPolicy:
    """What --seq-len and --truncate did to the samples, for the log, the metrics and the report."""

    seq_len: int
    truncate: bool
    kept: np.ndarray
    """Indices (into the store) of the samples kept."""
    lengths: np.ndarray
    """Tokens of each kept sample (after cutting)."""
    targets: np.ndarray
    """Target tokens of each kept sample (after cutting)."""
    dropped_long: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    """Samples without a target token left (cut past their answers, or none to begin with)."""
    target_tokens_lost: int = 0
    """Target tokens of the samples dropped as too long, or cut off by --truncate."""
    longest: int = 0
    samples: int = 0
    """Samples before the policy."""
    target_tokens: int = 0
    """Target tokens before the policy."""
    max_positions: int | None = None
    from_data: SeqLenChoice | None = field(default=None)
    """How the data chose --seq-len, when the user gave none."""

    @property
    def seq_len_keeping_all(self) -> int | None:
        """The --seq-len (a multiple of SEQ_LEN_MULTIPLE) that keeps every sample whole; None past the model's positions."""
        if self.max_positions and self.longest > self.max_positions:
            return None
        return round_up(self.longest, self.max_positions)

    @property
    def lost_percent(self) -> tuple[float, float]:
        """(% of the samples, % of the target tokens) dropped as longer than --seq-len."""
        return 100 * self.dropped_long / max(1, self.samples), 100 * self.target_tokens_lost / max(1, self.target_tokens)

    @property
    def over_limit(self) -> bool:
        """Whether the samples dropped as too long are more than LOSS_LIMIT_PERCENT of the samples or target tokens."""
        if self.truncate:
            return False  # --truncate asks for the cuts: they are said, not refused
        return (self.dropped_long * 100 > LOSS_LIMIT_PERCENT * self.samples
                or self.target_tokens_lost * 100 > LOSS_LIMIT_PERCENT * self.target_tokens)

    def facts(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len, "truncate": self.truncate, "samples_kept": int(len(self.kept)),
            "samples_dropped_long": self.dropped_long, "samples_truncated": self.truncated,
            "samples_dropped_no_target": self.dropped_no_target, "target_tokens_lost": self.target_tokens_lost,
            "longest_sample": self.longest, "samples_before": self.samples, "target_tokens_before": self.target_tokens,
            "seq_len_from_data": self.from_data is not None, "seq_len_keeping_all": self.seq_len_keeping_all,
        }


def start_policy(lengths: np.ndarray, targets: np.ndarray, seq_len: int | None, truncate: bool,
                 max_positions: int | None = None) -> LengthPolicy:
    """The policy of samples of these lengths and target tokens before any is dropped or cut: --seq-len, or the
    length from the data when it is None (within `max_positions`), and the counts before."""
    lengths = np.asarray(lengths, dtype=np.int64)
    choice = seq_len_from_data(lengths, targets, max_positions) if seq_len is None else None
    empty = np.zeros(0, np.int64)
    return LengthPolicy(choice.seq_len if choice is not None else int(seq_len), truncate, empty, empty, empty,
                        longest=int(lengths.max()) if len(lengths) else 0, samples=len(lengths),
                        target_tokens=int(np.sum(targets)), max_positions=max_positions, from_data=choice)


def _which(policy: LengthPolicy) -> str:
    return f"seq-len {policy.seq_len} (from the data)" if policy.from_data else f"--seq-len {policy.seq_len}"


def _fixes(policy: LengthPolicy) -> str:
    keep = policy.seq_len_keeping_all
    fixes = ([f"--seq-len {keep} to keep them"] if keep else []) + [
        f"--truncate to cut them to their first {policy.seq_len} tokens", "--allow-drop to train without them"]
    text = ", ".join(fixes[:-1]) + ("," if len(fixes) > 2 else "") + " or " + fixes[-1]
    if keep is None:
        text += f" (the model handles at most {policy.max_positions:,} positions; --rope-scale can extend a RoPE model's)"
    return text


def loss_message(policy: LengthPolicy, label: str) -> str:
    """The refusal of a length that drops too much: what would be lost and what to pass instead (one line)."""
    samples, targets = policy.lost_percent
    return (f"{_which(policy)} would drop {policy.dropped_long:,} of {policy.samples:,} samples of {label} ({samples:.1f}%:"
            f" longer than {policy.seq_len} tokens, the longest {policy.longest:,}) and {policy.target_tokens_lost:,}"
            f" of {policy.target_tokens:,} target tokens ({targets:.1f}%); pass {_fixes(policy)}")


def check_length_loss(policy: LengthPolicy, label: str, allow_drop: bool) -> None:
    """Refuse (UsageError, one line) a length that drops more than LOSS_LIMIT_PERCENT, unless `allow_drop`."""
    if policy.over_limit and not allow_drop:
        raise UsageError(loss_message(policy, label))


def length_lines(policy: LengthPolicy, label: str, allow_drop: bool = False) -> list[str]:
    """What the length did, one short line each: chosen from the data; samples dropped or cut; samples with nothing
    to train on dropped. Empty when the data fit as it is."""
    lines = [policy.from_data.describe()] if policy.from_data else []
    if policy.truncated:
        share = 100 * policy.target_tokens_lost / max(1, policy.target_tokens)
        lines.append(f"--truncate: {policy.truncated:,} of {policy.samples:,} samples of {label} cut to their first"
                     f" {policy.seq_len} tokens, {policy.target_tokens_lost:,} of {policy.target_tokens:,} target tokens"
                     f" cut ({share:.1f}%)")
    if policy.dropped_long:
        samples, targets = policy.lost_percent
        line = (f"{_which(policy)} drops {policy.dropped_long:,} of {policy.samples:,} samples of {label} ({samples:.1f}%,"
                f" longer than {policy.seq_len} tokens) and {policy.target_tokens_lost:,} of {policy.target_tokens:,}"
                f" target tokens ({targets:.1f}%)")
        keep = policy.seq_len_keeping_all
        if policy.over_limit and allow_drop:
            line = "--allow-drop: " + line
        lines.append(line + (f"; --seq-len {keep} keeps them" if keep else ""))
    if policy.dropped_no_target:
        lines.append(f"{policy.dropped_no_target:,} samples of {label} without a target token"
                     f"{' left after the cut' if policy.truncate else ''} dropped")
    return lines


def say_length(policy: LengthPolicy, label: str, allow_drop: bool, log: logging.Logger) -> None:
    """Log `length_lines`: the length from the data as information, what was dropped or cut as a warning."""
    for number, line in enumerate(length_lines(policy, label, allow_drop)):
        (log.info if number == 0 and policy.from_data is not None else log.warning)("memfit: %s", line)

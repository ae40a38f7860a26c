"""The plan of an RL step (--task grpo): how many completions to generate at once, and the longest completion.

An RL step generates its completions before it trains on them (prediction/rl_step.py), so a plan chooses two
batches: the training micro-batch (--batch-size, searched like any task's) and the generation batch
(--generation-batch-size). Generating more completions at once is faster and holds more cache and sampler buffers;
the training pass does not depend on it. So each configuration the planner estimates gets the largest generation
batch that fits beside it: every completion of the step, else half as many (rounded up, as the rollout halves on
out-of-memory), down to one. A batch the user gave stays.

`--maximize completion-length` (only for --task grpo) searches the longest --max-completion-length that fits, to the
token, at the step's completions (micro-batch 1 unless --batch-size is given, accumulation keeping the step's
completions), each length with its own generation batch.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import UsageError
from memfit.prediction.candidates import technique_grid, user_set
from memfit.prediction.plan_result import Candidate
from memfit.prediction.rl_step import is_rl

COMPLETION_LENGTH = "completion-length"
"""The --maximize choice of an RL run: the longest --max-completion-length that fits."""
MAXIMIZE_CHOICES = ("seq-len", "batch-size", COMPLETION_LENGTH)
MAX_COMPLETION_TOKENS = 1 << 20
"""The longest completion the search tries where the model's positions do not bound it."""


def check_maximize(config: Any, maximize: str | None) -> None:
    """UsageError for a --maximize that is not a choice, or completion-length for a task that generates nothing."""
    if maximize is not None and maximize not in MAXIMIZE_CHOICES:
        raise UsageError(f"--maximize must be one of {', '.join(MAXIMIZE_CHOICES)}, got {maximize!r}")
    if maximize == COMPLETION_LENGTH and not is_rl(config):
        raise UsageError(f"--maximize completion-length plans --task grpo's completions; --task {config.task.task}"
                         f" chooses from seq-len, batch-size")


def plans_generation(search: Any, changes: dict[str, Any]) -> bool:
    """Whether `changes` still needs its generation batch chosen (an RL run's, not chosen yet)."""
    return is_rl(search.config) and "generation_batch_size" not in changes


def with_generation_batch(search: Any, changes: dict[str, Any], micro: int, accumulation: int,
                          seq_len: int) -> Candidate:
    """`changes` at the largest generation batch that fits beside them (module docstring); the user's if given."""
    if user_set(search.config, "generation_batch_size") and search.config.rl.generation_batch_size:
        return search.candidate({**changes, "generation_batch_size": search.config.rl.generation_batch_size},
                                micro, accumulation, seq_len)
    size = max(1, micro * accumulation)
    while True:
        candidate = search.candidate({**changes, "generation_batch_size": size}, micro, accumulation, seq_len)
        if size == 1 or search.device_fits(candidate):
            return candidate
        size = (size + 1) // 2


def longest_completion(search: Any, mode: str, effective: int, trained_positions: int | None
                       ) -> tuple[list[Candidate], list[Candidate]]:
    """(every configuration tried, those that fit) of `mode` at the longest completion that fits, to the token."""
    config = search.config
    per_rank = max(1, effective // search.world_size)
    micro = config.training.batch_size if user_set(config, "batch_size") else 1
    accumulation = max(1, per_rank // micro)
    prompt = int(config.rl.max_prompt_length or config.data.seq_len)
    limit = max(1, (trained_positions or MAX_COMPLETION_TOKENS + prompt) - prompt)
    seq = config.data.seq_len
    best, found = 0, []
    for changes in technique_grid(mode, config, search.gpu, seq, accumulation, hf_config=search.hf_config):
        def at(tokens: int, changes=changes) -> Candidate:
            return search.candidate({**changes, "max_completion_length": tokens}, micro, accumulation, seq)

        length = _longest_fitting(search, at, max(1, best), limit)
        if length:
            best = max(best, length)
            found.append(at(length))
    fitting = [c for c in found if c.changes["max_completion_length"] == best]
    tried = fitting or [at_shortest(search, mode, micro, accumulation)]
    return tried, fitting


def _longest_fitting(search: Any, at: Any, floor: int, limit: int) -> int:
    """The longest length from `floor` to `limit` whose candidate fits (0 when `floor` does not): doubling, then
    bisecting to one token."""
    floor = min(floor, limit)
    if not search.fits(at(floor)):
        return 0
    low, high = floor, floor * 2
    while high <= limit and search.fits(at(high)):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if search.fits(at(middle)) else (low, middle)
    return low


def at_shortest(search: Any, mode: str, micro: int, accumulation: int) -> Candidate:
    """The last (smallest) configuration of `mode` at one completion token: how far off the budget is, when nothing
    fits."""
    config = search.config
    changes = technique_grid(mode, config, search.gpu, config.data.seq_len, accumulation)[-1]
    return search.candidate({**changes, "max_completion_length": 1}, micro, accumulation, config.data.seq_len)


def completion_length_order(candidate: Candidate) -> tuple[int, float]:
    """Sort key of --maximize completion-length: the longest completion first, then the fastest."""
    return -int(candidate.changes.get("max_completion_length", 0)), -candidate.tokens_per_second


def describe_generation(changes: dict[str, Any]) -> str:
    """The plan's words for an RL run's two batches ('' for another task)."""
    parts = []
    if changes.get("max_completion_length"):
        parts.append(f"completions of {changes['max_completion_length']:,} tokens")
    if changes.get("generation_batch_size"):
        parts.append(f"generating {changes['generation_batch_size']} at once")
    return ", ".join(parts)


def generation_trades(best: Candidate, config: Any, maximize: str | None, trained_positions: int | None,
                      gpu: Any = None, hf_config: Any = None) -> list[str]:
    """What an RL plan's generation trades: the step's predicted time split into generation and training (with
    `hf_config`), rounds of generation where the step's completions do not fit at once, and, for the longest
    completion, whether the model's positions rather than memory bound it."""
    if not is_rl(config):
        return []
    changes, lines = best.changes, []
    if hf_config is not None:
        lines.append(step_split_line(best, config, gpu, hf_config))
    completions = changes["batch_size"] * changes["gradient_accumulation_steps"]
    size = changes.get("generation_batch_size") or completions
    if size < completions:
        rounds = -(-completions // size)
        lines.append(f"generation: {size} of the step's {completions} completions at once ({rounds} rounds a step):"
                     " all of them at once do not fit beside the rest of the run")
    length = changes.get("max_completion_length")
    prompt = int(config.rl.max_prompt_length or config.data.seq_len)
    if maximize == COMPLETION_LENGTH and trained_positions and length == trained_positions - prompt:
        lines.append(f"completions of {length:,} tokens: the model's {trained_positions:,} positions less the"
                     f" {prompt:,}-token prompt bound them, not memory")
    return lines


def step_split_line(best: Candidate, config: Any, gpu: Any, hf_config: Any) -> str:
    """The plan's predicted step in words: generation, scoring and training (prediction/rl_speed.py), as ranked."""
    from memfit.prediction.speed_model import rl_step_seconds

    split = rl_step_seconds(best.changes, config, best.estimate, gpu, hf_config)
    parts = [f"{name} {seconds:.3g} s ({100 * seconds / max(split.total, 1e-12):.0f}%)"
             for name, seconds in (("generation", split.generation), ("scoring", split.scoring),
                                   ("training", split.training)) if seconds or name != "scoring"]
    return f"predicted step {split.total:.3g} s: " + ", ".join(parts)

"""Find the fastest training configuration that fits a GPU or a memory budget.

    from memfit import load_config, plan
    result = plan(load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048}), gpu="rtx-4090")
    print(result.command)

The search tries micro-batch sizes (powers of two, accumulation keeping the effective
batch), checkpointing off/selective/full, 8-bit AdamW, chunked loss and optimizer
offload, for full training, LoRA and QLoRA as `allow` permits. Offloaded checkpoints
offload the fewest blocks' inputs that fit the device (`activation_offload_blocks`). It keeps what the
analytical estimate puts under the budget with a 5 % margin and ranks it by estimated
tokens per second (`memfit.prediction.speed_model.estimated_step_seconds`).

Why this module is longer than the others (about 500 lines): the search, the longest-context
and largest-batch searches, and what a plan trades and prints share one `_Search` over one
technique grid; the speed model lives in `speed_model.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.config import TrainConfig
from memfit.errors import DoesNotFitError, UsageError
from memfit.gpus import GpuSpec, get_gpu, local_gpu
from memfit.models.optimizer_state import PLANNING, distance_from_adamw
from memfit.prediction.activations import architecture_of
from memfit.prediction.candidates import modes_of, technique_grid, user_set
from memfit.prediction.context_parallel_plan import plan_longest_context, searches_context_parallel
from memfit.prediction.estimator import estimate
from memfit.prediction.expert_streaming import prefer_resident
from memfit.prediction.plan_result import Candidate, PlanResult, plan_to_overrides  # noqa: F401  (plan_to_overrides: re-exported with plan)
from memfit.prediction.rl_plan import (
    COMPLETION_LENGTH,
    check_maximize,
    completion_length_order,
    generation_trades,
    longest_completion,
    plans_generation,
    with_generation_batch,
)
from memfit.prediction.speed_model import estimated_step_seconds
from memfit.prediction.trade_offs import trade_offs, train_command
from memfit.prediction.trial_order import shapes_first
from memfit.units import GIB, format_bytes

MARGIN = 0.05
"""Fraction of the budget kept free: the analytical estimate's error band is 10 %, usually less."""
ALLOW = ("auto", "full", "lora", "qlora", "any")


@dataclass
class _Search:
    config: TrainConfig
    hf_config: Any
    budget: int
    gpu: GpuSpec | None
    world_size: int
    sharding: str
    precision: str
    host_limit: int | None = None

    def candidate(self, changes: dict[str, Any], micro: int, accumulation: int, seq_len: int) -> Candidate:
        """`changes` estimated at this shape; offloaded checkpoints offload the fewest blocks that fit."""
        if plans_generation(self, changes):  # an RL run: the generation batch that fits beside them (rl_plan.py)
            return with_generation_batch(self, changes, micro, accumulation, seq_len)
        user_blocks = user_set(self.config, "activation_offload_blocks")
        if "activation_offload_blocks" in changes:
            return self._candidate(changes, micro, accumulation, seq_len)
        if not (changes.get("activation_offload") and changes.get("gradient_checkpointing") == "full"):
            # a run that offloads no blocks, or everything saved: a given block count does not apply
            cleared = {"activation_offload_blocks": None} if self.config.memory.activation_offload_blocks is not None else {}
            return self._candidate({**changes, **cleared}, micro, accumulation, seq_len)
        if user_blocks:
            return self._candidate(changes, micro, accumulation, seq_len)
        return self._fewest_offloaded_blocks(changes, micro, accumulation, seq_len)

    def _fewest_offloaded_blocks(self, changes: dict[str, Any], micro: int, accumulation: int,
                                 seq_len: int) -> Candidate:
        """Offloaded checkpoints with the fewest block inputs in host memory that fit the device.

        The device peak falls and the host bytes and host-link traffic grow with each offloaded
        block (the first N go, the last stay: backward needs those first), so the fewest that fit
        the device leave the most host memory and the least traffic. When all blocks' inputs do not
        make it fit, everything saved goes (the head's inputs too: `activation_offload_blocks` None).
        """
        layers = architecture_of(self.hf_config).layers

        def at(blocks: int | None) -> Candidate:
            return self._candidate({**changes, "activation_offload_blocks": blocks}, micro, accumulation, seq_len)

        device_fits = self.device_fits
        every = at(None)
        if not device_fits(every):
            return every  # nothing fits the device: full offload comes closest
        low, high, best = 0, layers, at(layers)  # low: does not fit (0 blocks is no offload)
        if not device_fits(best):
            return every
        while high - low > 1:
            middle = (low + high) // 2
            tried = at(middle)
            if device_fits(tried):
                high, best = middle, tried
            else:
                low = middle
        return best

    def _candidate(self, changes: dict[str, Any], micro: int, accumulation: int, seq_len: int) -> Candidate:
        changes = {"batch_size": micro, "gradient_accumulation_steps": accumulation, "precision": self.precision,
                   **changes}
        if seq_len != self.config.data.seq_len:
            changes["seq_len"] = seq_len
        candidate_config = self.config.replace(effective_batch_size=None, memory_budget=None, gpu=None, **changes)
        est = estimate(candidate_config, world_size=self.world_size, sharding=self.sharding, gpu=self.gpu,
                       budget_bytes=self.budget, hf_config=self.hf_config)
        seconds = estimated_step_seconds(changes, self.config, est, self.gpu, self.hf_config)
        return Candidate(changes, est, seconds, candidate_config.effective_batch_for(self.world_size) * seq_len)

    def fits(self, candidate: Candidate) -> bool:
        if self.host_limit is not None and candidate.estimate.host_peak_bytes > self.host_limit * (1 - HOST_MARGIN):
            return False
        return self.device_fits(candidate)

    def device_fits(self, candidate: Candidate) -> bool:
        return candidate.estimate.peak_bytes <= self.budget * (1 - MARGIN)


def _fastest(search: _Search, mode: str, effective: int) -> list[Candidate]:
    """Every configuration of `mode` at the config's sequence length keeping the effective batch."""
    per_rank = max(1, effective // search.world_size)
    seq = search.config.data.seq_len
    found = []
    for micro in [2**k for k in range(0, int(math.log2(per_rank)) + 1)]:
        if per_rank % micro:
            continue
        accumulation = per_rank // micro
        for changes in technique_grid(mode, search.config, search.gpu, seq, accumulation, hf_config=search.hf_config):
            found.append(search.candidate(changes, micro, accumulation, seq))
    return found


SEQ_STEP = 256
MAX_SEQ_LEN = 1 << 23


def _longest(search: _Search, mode: str, micro: int, accumulation: int, limit: int = MAX_SEQ_LEN) -> list[Candidate]:
    """For each technique combination, the longest sequence (a multiple of 256, at most `limit`) that fits."""
    best_seq, found = 0, []
    grid_seq_len = 1 << 20
    grid = technique_grid(mode, search.config, search.gpu, grid_seq_len, accumulation, long_context=True,
                          hf_config=search.hf_config)
    for changes in grid:
        tile_tokens = grid_seq_len // changes["tiled_mlp"] if changes["tiled_mlp"] else 0

        def at(seq: int, changes=changes, tile_tokens=tile_tokens) -> Candidate:
            # tiles follow the length at the grid's tokens per tile (at least 2) when it turned tiling on
            tiles = max(2, math.ceil(seq / tile_tokens)) if tile_tokens else 0
            return search.candidate({**changes, "tiled_mlp": tiles}, micro, accumulation, seq)

        floor = min(max(SEQ_STEP, best_seq), limit)
        if not search.fits(at(floor)):
            continue  # cannot beat (or match) the best found so far
        low, high = floor, floor * 2
        while high <= limit and search.fits(at(high)):
            low, high = high, high * 2
        if high > limit:
            if search.fits(at(limit)):
                low, high = limit, limit + 1
            else:
                high = limit
        while high - low > SEQ_STEP:
            middle = (low + high) // 2 // SEQ_STEP * SEQ_STEP
            low, high = (middle, high) if search.fits(at(middle)) else (low, middle)
        best_seq = max(best_seq, low)
        found.append(at(low))
    return [c for c in found if c.changes.get("seq_len", search.config.data.seq_len) == best_seq]


def _largest_batch(search: _Search, mode: str) -> list[Candidate]:
    """For each technique combination, the largest micro-batch (one per step) that fits."""
    best, found = 0, []
    seq = search.config.data.seq_len
    for changes in technique_grid(mode, search.config, search.gpu, seq, 1, hf_config=search.hf_config):
        floor = max(1, best)
        if not search.fits(search.candidate(changes, floor, 1, seq)):
            continue
        low, high = floor, floor * 2
        while high <= 1 << 20 and search.fits(search.candidate(changes, high, 1, seq)):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if search.fits(search.candidate(changes, middle, 1, seq)) else (low, middle)
        best = max(best, low)
        found.append(search.candidate(changes, low, 1, seq))
    return [c for c in found if c.changes["batch_size"] == best]


MAXIMIZE = (None, "seq-len", "batch-size")
HOST_MARGIN = 0.25
"""Fraction of the host memory left to the process itself, the data and the OS (not modelled)."""


def machine_memory_bytes() -> int | None:
    """Total memory of this machine (psutil, else /proc/meminfo), or None."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing: read the kernel's figure, else give up on the check
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemTotal:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def plan(
    config: TrainConfig,
    budget_bytes: int | None = None,
    gpu: GpuSpec | str | None = None,
    allow: str = "auto",
    effective_batch_size: int | None = None,
    world_size: int = 1,
    sharding: str = "none",
    hf_config: Any = None,
    explain: bool = True,
    maximize: str | None = None,
    host_memory: int | None = None,
) -> PlanResult:
    """The fastest configuration of `config` whose estimated peak fits the budget.

    Args:
        budget_bytes: memory per device; default: the GPU's.
        gpu: GPU preset (name or GpuSpec): memory, bf16 support, speed.
        allow: full, lora, qlora, any, or auto (full if it fits, else LoRA, else QLoRA).
        effective_batch_size: samples per optimizer step; default: the config's.
        world_size, sharding: devices and how they share state (none/ddp/zero1-3/fsdp).
        explain: when nothing fits, work out what would (a wider --allow, more GPUs) for the message.
        maximize: None (fastest at the config's sequence length and effective batch),
            "seq-len" (the longest sequence that fits, at the given micro-batch, 1 unless
            --batch-size is given) or "batch-size" (the largest micro-batch at --seq-len).
            The fastest of the configurations that reach the maximum is chosen.
        host_memory: host memory the plan may fill with offloaded activations and optimizer
            state (75 % of it: the rest is left to the process and the OS); default: this
            machine's total memory, so plan on the machine that trains or say how much it has.

    Without --seq-len (None: from the data, which `plan` does not read) the plan is made at 256 tokens;
    `memfit plan --dataset D` and a planned `memfit train` take the length from the data first.

    Raises:
        DoesNotFitError: nothing fits; the message says how much is needed and what to try.
        UsageError: neither a budget nor a GPU, or a bad `allow` / `maximize`.
    """
    from memfit.models.presets import resolve_model_config
    from memfit.models.rope import scaled_positions

    config = config.with_seq_len()  # not given: DEFAULT_SEQ_LEN
    if allow not in ALLOW:
        raise UsageError(f"--allow must be one of {', '.join(ALLOW)}, got {allow!r}")
    check_maximize(config, maximize)  # seq-len, batch-size, or completion-length for --task grpo (rl_plan.py)
    gpu_spec, budget = _device_and_budget(config, gpu, budget_bytes)
    if hf_config is None:
        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    if searches_context_parallel(config, maximize, world_size):  # each context-parallel size, the longest wins
        return plan_longest_context(config, gpus=world_size, hf_config=hf_config, plan_one=plan, budget_bytes=budget_bytes,
                                    gpu=gpu, allow=allow, effective_batch_size=effective_batch_size, host_memory=host_memory)
    effective = effective_batch_size or config.effective_batch_for(world_size)
    if world_size > 1 and sharding == "none":
        sharding = "fsdp"
    host_limit = host_memory if host_memory is not None else machine_memory_bytes()
    search = _Search(config, hf_config, budget, gpu_spec, world_size, sharding,
                     "auto" if gpu_spec is not None else config.memory.precision, host_limit)
    # the model's positions, x --rope-scale (refused for a model without RoPE)
    trained_positions = scaled_positions(hf_config, config.model.rope_scale, config.model.rope_scaling)
    searched = _search_modes(search, allow, maximize, effective, trained_positions)
    if not searched.chosen:
        if not explain:
            raise DoesNotFitError("does not fit")
        raise DoesNotFitError(_does_not_fit_message(
            config, hf_config, budget, gpu_spec, allow, searched.everything, effective,
            _host_limit_message(search, searched.everything, host_memory is not None)))
    return _plan_result(search, _ordered(searched.chosen, maximize, config, budget), searched, maximize, budget_bytes,
                        trained_positions)


def _device_and_budget(config: TrainConfig, gpu: GpuSpec | str | None,
                       budget_bytes: int | None) -> tuple[GpuSpec | None, int]:
    """The GPU the plan is made for (the named one, the config's, else this machine's) and the memory it must fit;
    UsageError when neither a budget nor a GPU says how much."""
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu_spec is None and config.memory.gpu:
        gpu_spec = get_gpu(config.memory.gpu)
    if gpu_spec is None:
        gpu_spec = local_gpu()  # training here: its GPU's speed, bf16 and host link (a budget still caps memory)
    budget = budget_bytes or config.memory.memory_budget or (gpu_spec.memory_bytes if gpu_spec else None)
    if budget is None:
        raise UsageError("memfit plan needs --gpu NAME or --memory-budget SIZE (e.g. --memory-budget 24GiB)")
    return gpu_spec, budget


@dataclass
class _Searched:
    """What the search over the modes found."""

    chosen: list[Candidate]
    """The configurations that fit, of every mode tried."""
    everything: list[Candidate]
    """Every configuration estimated (what does not fit says how far off it is; the paged comparison reads them)."""
    memory_seq_len: int | None
    """--maximize seq-len: the longest sequence memory allows where it is past the model's positions (else None)."""


def _search_modes(search: _Search, allow: str, maximize: str | None, effective: int,
                  trained_positions: int | None) -> _Searched:
    """The configurations of each mode `allow` permits that reach `maximize` (or keep the effective batch), least
    lossy mode first; under 'auto' the first mode with one that fits ends the search."""
    config = search.config
    searched = _Searched([], [], None)
    for mode in modes_of(allow):
        if maximize == "seq-len":
            found, fitting = _longest_of_mode(search, mode, trained_positions, searched)
        elif maximize == COMPLETION_LENGTH:
            found, fitting = longest_completion(search, mode, effective, trained_positions)
        elif maximize == "batch-size":
            fitting = _largest_batch(search, mode)
            found = fitting or [search.candidate(technique_grid(mode, config, search.gpu, config.data.seq_len, 1)[-1],
                                                 1, 1, config.data.seq_len)]
        else:
            found = _fastest(search, mode, effective)
            fitting = prefer_resident([c for c in found if search.fits(c)])  # experts streamed only when needed
        searched.everything += found
        searched.chosen += fitting
        if allow == "auto" and fitting:
            break  # the least lossy mode that fits wins
    return searched


def _longest_of_mode(search: _Search, mode: str, trained_positions: int | None,
                     searched: _Searched) -> tuple[list[Candidate], list[Candidate]]:
    """(every configuration tried, those that fit) of `mode` at the longest sequence, at most the model's positions;
    how far memory alone would go past them goes to `searched.memory_seq_len`."""
    config = search.config
    micro = config.training.batch_size if user_set(config, "batch_size") else 1
    accumulation = config.training.gradient_accumulation_steps if user_set(
        config, "gradient_accumulation_steps") else 1
    fitting = _longest(search, mode, micro, accumulation)
    if fitting and trained_positions and fitting[0].changes["seq_len"] > trained_positions:
        # memfit train refuses windows past the model's positions: plan the longest it runs,
        # and report how far memory alone would go
        searched.memory_seq_len = max(searched.memory_seq_len or 0, fitting[0].changes["seq_len"])
        fitting = _longest(search, mode, micro, accumulation, limit=trained_positions)
    found = fitting or [search.candidate(technique_grid(mode, config, search.gpu, SEQ_STEP, accumulation)[-1],
                                         micro, accumulation, SEQ_STEP)]
    return found, fitting


def _ordered(chosen: list[Candidate], maximize: str | None, config: TrainConfig, budget: int) -> list[Candidate]:
    """The configurations that fit, best first: by what is maximized, then speed (else as `rank` orders them)."""
    if maximize == "seq-len":
        chosen.sort(key=lambda c: (-c.changes.get("seq_len", config.data.seq_len), -c.tokens_per_second))
    elif maximize == "batch-size":
        chosen.sort(key=lambda c: (-c.changes["batch_size"], -c.tokens_per_second))
    elif maximize == COMPLETION_LENGTH:
        chosen.sort(key=completion_length_order)
    else:
        chosen = rank(chosen, budget)
    return chosen


def _plan_result(search: _Search, chosen: list[Candidate], searched: _Searched, maximize: str | None,
                 budget_bytes: int | None, trained_positions: int | None) -> PlanResult:
    """The plan of the best configuration: its command, the runners-up, what it trades, the trials' candidates."""
    from memfit.models.rope import can_scale, scaled_positions, suggested_scale

    config, hf_config, gpu_spec, memory_seq_len = search.config, search.hf_config, search.gpu, searched.memory_seq_len
    best = chosen[0]
    alternatives = [_describe(c, best) for c in _distinct(chosen)[1:3]]
    ranked = [{"plan": dict(c.changes), "step_seconds": c.step_seconds, "estimated_peak_bytes": c.estimate.peak_bytes}
              for c in shapes_first(_distinct(chosen), lambda c: c.changes)[:TRIAL_CANDIDATES]]  # for trials
    if config.model.rope_scale is not None:  # the planned positions need the scaled model: the command carries it
        best.changes["rope_scale"] = config.model.rope_scale
        if config.model.rope_scaling != "auto":
            best.changes["rope_scaling"] = config.model.rope_scaling
    est = best.estimate
    seq_len = best.changes.get("seq_len", config.data.seq_len)
    return PlanResult(
        fits=True, plan={"seq_len": seq_len, **best.changes}, estimated_peak_bytes=est.peak_bytes,
        budget_bytes=int(search.budget), relative_speed=1.0,
        command=train_command(config, best.changes, gpu_spec, budget_bytes, search.world_size),
        alternatives=alternatives, tokens_per_second=best.tokens_per_second,
        host_bytes=est.host_bytes, host_available_bytes=est.host_available_bytes, host_limit_bytes=search.host_limit,
        rank_note=best.rank_note,
        load_host_bytes=est.load_host_bytes,
        trades=trade_offs(best, config, hf_config, gpu_spec, search.host_limit, memory_seq_len)
        + [line for line in [_paged_comparison(best, searched.everything, search)] if line]
        + generation_trades(best, config, maximize, trained_positions, gpu_spec, hf_config), maximize=maximize,
        memory_limit_seq_len=memory_seq_len or (seq_len if maximize == "seq-len" else None),
        max_positions=trained_positions, device=gpu_spec.name if gpu_spec is not None else "cpu", ranked=ranked,
        rope_scale_to_memory_limit=suggested_scale(
            scaled_positions(hf_config, None), memory_seq_len) if memory_seq_len and can_scale(hf_config) else None,
    )


TRIAL_CANDIDATES = 24
"""Distinct configurations a plan ranks for trials to time (the trials' cost bounds how many run)."""
LOSSY_SPEEDUP = 1.2
"""A small-state optimizer's plan is chosen over an AdamW or 8-bit AdamW plan that fits only when it is expected to
be at least this much faster (the 8B full fine-tune at batch 2: APOLLO-Mini, 1.29x the paged 8-bit plan)."""


def rank(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """The plans that fit, best first: by expected speed, except where the planner prefers a plan for what it
    trades (fp32 weights before pure bf16 ones; AdamW and 8-bit AdamW before a small-state optimizer less than
    LOSSY_SPEEDUP faster, which is then dropped) or for its headroom (PEAK_TIE). A plan ranked before a faster one
    says why in its `rank_note`, which `memfit plan` prints with it: the order shown is the order it says."""
    ranked = sorted(candidates, key=lambda c: (_pure_bf16(c), -c.tokens_per_second,
                                               distance_from_adamw(c.changes.get("optimizer")), c.estimate.peak_bytes))
    ranked = _closest_to_adamw_first(ranked)
    _note_fp32_first(ranked)  # after the small-state plans that do not pay are dropped: it compares what is left
    return _smaller_peak_first(ranked, budget)


def _pure_bf16(candidate: Candidate) -> bool:
    """Full training with bf16 weights (no fp32 master copy): ranked after every fp32-weight plan."""
    return candidate.changes.get("dtype") == "bf16" and not candidate.changes.get("lora_r")


def _note_fp32_first(ranked: list[Candidate]) -> None:
    """Each fp32-weight plan slower than the fastest pure-bf16 one, which it ranks before, says so."""
    bf16 = [c for c in ranked if _pure_bf16(c)]
    if not bf16:
        return
    fastest = max(bf16, key=lambda c: c.tokens_per_second)
    for c in ranked:
        if not _pure_bf16(c) and c.tokens_per_second < fastest.tokens_per_second:
            c.add_rank_note(f"ranked before faster plans with pure bf16 weights (up to"
                            f" {fastest.tokens_per_second / c.tokens_per_second:.2f}x its speed): its fp32 weights"
                            " keep the small updates that bf16 rounds away")


def _closest_to_adamw_first(ranked: list[Candidate]) -> list[Candidate]:
    """`ranked` (best first), or only its AdamW and 8-bit AdamW plans when one of them fits and no small-state
    plan is LOSSY_SPEEDUP times faster than the best of them (the runners-up are then AdamW's too)."""
    exact = [c for c in ranked if c.changes.get("optimizer") not in PLANNING]
    if exact and ranked[0] is not exact[0] and ranked[0].tokens_per_second < LOSSY_SPEEDUP * exact[0].tokens_per_second:
        return exact
    return ranked


PEAK_TIE = 0.03
"""When the fastest plan fills more than TIGHT of the budget, plans expected within this fraction of its tokens/s, with
its optimizer and weight dtype, count as equally fast: the smallest peak among them is chosen (headroom against the
estimate's error band)."""
TIGHT = 0.8


def _smaller_peak_first(ranked: list[Candidate], budget: int) -> list[Candidate]:
    """`ranked` with the smallest-peak plan among those as fast as its best (PEAK_TIE) moved to the front, when the
    best fills more than TIGHT of the budget (with room to spare the fastest stays first)."""
    best = ranked[0]
    if best.estimate.peak_bytes <= TIGHT * budget:
        return ranked
    same = [c for c in ranked if c.tokens_per_second >= (1 - PEAK_TIE) * best.tokens_per_second
            and c.changes.get("optimizer") == best.changes.get("optimizer")
            and c.changes.get("dtype") == best.changes.get("dtype")]
    smallest = min(same, key=lambda c: c.estimate.peak_bytes)
    if smallest.tokens_per_second < best.tokens_per_second:
        smallest.add_rank_note(
            f"ranked first for headroom: {format_bytes(best.estimate.peak_bytes - smallest.estimate.peak_bytes)} less peak"
            f" than the fastest plan, which fills {100 * best.estimate.peak_bytes / budget:.0f}% of the budget and is"
            f" expected {100 * (best.tokens_per_second / smallest.tokens_per_second - 1):.1f}% faster (plans within"
            f" {100 * PEAK_TIE:.0f}% of the fastest count as equally fast)")
    return [smallest] + [c for c in ranked if c is not smallest]


def _paged_comparison(best: Candidate, everything: list[Candidate], search: _Search) -> str | None:
    """How the chosen plan compares with the best plan that pages its optimizer state to the host."""
    paged = [c for c in everything if c.changes.get("optimizer") == "paged-adamw-8bit" and search.fits(c)]
    if best.changes.get("optimizer") == "paged-adamw-8bit" or not paged:
        return None
    fastest = max(paged, key=lambda c: c.tokens_per_second)
    return (f"nothing paged to the host: expected {best.tokens_per_second / fastest.tokens_per_second:.2f}x the"
            f" tokens/s of the best paged-state plan (paged-adamw-8bit, peak {fastest.estimate.peak_bytes / GIB:.2f}"
            f" GiB, {fastest.estimate.host_breakdown.get('optimizer_states', 0) / GIB:.1f} GiB of state in unified"
            " memory)")


def _distinct(candidates: list[Candidate]) -> list[Candidate]:
    """Drop runners-up that differ from a better one only by switches that change nothing shown."""
    seen, kept = set(), []
    for c in candidates:
        key = tuple(sorted((k, v) for k, v in c.changes.items() if k != "gradient_accumulation_steps"))
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def _describe(candidate: Candidate, best: Candidate) -> dict[str, Any]:
    return {
        "plan": dict(candidate.changes),
        "estimated_peak_bytes": candidate.estimate.peak_bytes,
        "relative_speed": round(candidate.tokens_per_second / best.tokens_per_second, 3),
        "rank_note": candidate.rank_note,
    }


def _does_not_fit_message(config, hf_config, budget, gpu, allow, everything, effective, host_limited=None) -> str:
    smallest = min(everything, key=lambda c: c.estimate.peak_bytes)
    need = smallest.estimate.peak_bytes / (1 - MARGIN)
    hints = []
    if allow in ("full", "lora"):
        wider = "qlora" if allow == "lora" else "lora"
        try:
            plan(config, budget, gpu, allow="any" if allow == "full" else "qlora", effective_batch_size=effective, hf_config=hf_config, explain=False)
            hints.append(f"use --allow {wider if allow == 'full' else 'qlora'}")
        except DoesNotFitError:
            pass
    for ranks in (2, 4, 8):
        try:
            plan(config, budget, gpu, allow=allow, effective_batch_size=max(effective, ranks), world_size=ranks,
                 sharding="fsdp", hf_config=hf_config, explain=False)
            hints.append(f"{ranks} GPUs with --sharding fsdp (or --zero-stage 3)")
            break
        except DoesNotFitError:
            continue
    if host_limited:
        return host_limited + ("; or " + " or ".join(hints) if hints else "")
    hint = ": " + " or ".join(hints) if hints else ": use a smaller model, a shorter --seq-len or a larger GPU"
    where = f"the {gpu.name}'s" if gpu is not None and budget == gpu.memory_bytes else "the --memory-budget"
    return (f"device memory stopped it: needs {need / GIB:.1f} GiB with everything on, {(need - budget) / GIB:.1f} GiB"
            f" over {where} {budget / GIB:.1f} GiB (--gpu / --memory-budget set it){hint}")


def _host_use(est) -> str:
    """What fills the host memory of an estimate at its most: the load (a staged load) or the steps."""
    if est.load_host_bytes > est.host_bytes:
        return f"the staged load of the model; {est.host_bytes / GIB:.1f} GiB while training"
    return "offloaded or paged state"


def _host_limit_message(search: _Search, everything: list[Candidate], host_memory_given: bool) -> str | None:
    """When configurations fit the device but every one needs more host memory than planned: say so, and the flag."""
    device_fits = [c for c in everything if search.device_fits(c)]
    if not device_fits or search.host_limit is None:
        return None
    least = min(device_fits, key=lambda c: c.estimate.host_peak_bytes)
    allowed = search.host_limit * (1 - HOST_MARGIN)
    source = "--host-memory" if host_memory_given else "this machine's memory; --host-memory SIZE plans for another"
    return (f"host memory stopped it: configurations that fit the device's {search.budget / GIB:.1f} GiB need at least"
            f" {least.estimate.host_peak_bytes / GIB:.1f} GiB of host memory ({_host_use(least.estimate)}), "
            f"{(least.estimate.host_peak_bytes - allowed) / GIB:.1f} GiB over the {allowed / GIB:.1f} GiB planned"
            f" ({100 * (1 - HOST_MARGIN):.0f} % of {search.host_limit / GIB:.1f} GiB, {source}): give --host-memory"
            " for the machine that trains, or a larger GPU")

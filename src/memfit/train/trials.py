"""Trials: before a planned run, time the planner's best few configurations and train with the fastest measured.

    config = with_trials(config, result)   # called by train/planned.py after the planner

The speed model ranks configurations from FLOPs and constants measured on one machine; on the
next one its order can be wrong. So before a run planned by --memory-budget / --gpu, each of the
planner's best distinct configurations (PlanResult.ranked) runs a few real micro-batches under the
same memory cap (the tracker's emulated cap on a CPU, the allocator's on CUDA: the cap given, else
the budget), and the fastest measured wins. A trial that runs out of memory is dropped.

What a trial runs: one step of one micro-batch (the optimizer's state made, kernels warmed up), one
tracked under the cap (two micro-batches where the plan accumulates) for the peak, then one step of
one micro-batch (t1) and, where the plan accumulates, one of two (t2). A micro-batch costs
m = t2 - t1 and the optimizer step o = t1 - m, so a step of `a` micro-batches costs a*m + o: four
short steps whatever the accumulation. Trials run eager (a compiled plan keeps --compile; its gain is the same factor on
every candidate in the speed model).

The cost is bounded: the trials stop once they would pass TRIAL_SHARE of the run's predicted
time, and none runs when two would not fit in it (a run too short to repay them). Results are
cached per model shape, device, torch version and settings (`memfit.prediction.calibration`'s
file), so the next run with the same shape starts at once; every measurement also calibrates the
speed model, so `memfit plan` ranks better without trials the second time.

Trials never change the run: each builds its own session from the same model and data, throws
it away, and the random number generators are restored afterwards, so the run starts from the
same weights, RNG state and data order as without them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memfit.config import TrainConfig
from memfit.memory.cap import is_out_of_memory
from memfit.prediction import calibration
from memfit.prediction.trial_order import shapes_first
from memfit.resolution.resolve import resolve
from memfit.train.trial_steps import time_steps
from memfit.units import format_bytes

log = logging.getLogger("memfit")

TRIAL_SHARE = 0.1
"""The trials may take at most this share of the planned run's predicted time."""
BUILD_SECONDS_GUESS = 1.0
"""Building a trial's session (model, data, optimizer) before one was timed, plus loading its weights at 1 GB/s."""
MAX_TRIALS = 5
"""Configurations timed at most (the planner's first and its closest runners-up)."""
SKIPPED_KEYS = ("compile",)
"""Changes a trial does not run (see the module docstring) and the cache does not key on."""


SLOWER_THAN_MEASURED = "predicted slower than measured"
"""A trial's status when it is not timed because a configuration measured before beats its prediction."""


@dataclass
class Trial:
    plan: dict[str, Any]
    predicted_seconds: float
    """The speed model's step time on this device (calibrated where it was; else scaled by a matmul probe)."""
    estimated_peak_bytes: int
    measured_seconds: float | None = None
    peak_bytes: int | None = None
    """Tracked (CPU) or allocated (CUDA) peak of the trial's steps."""
    status: str = "not run"
    """'measured', 'cached', 'over cap' (dropped), 'failed: ...' (dropped), 'not run' (out of time), or
    SLOWER_THAN_MEASURED (not timed: predicted slower than a configuration measured before)."""

    @property
    def usable(self) -> bool:
        return self.status in ("measured", "cached") and self.measured_seconds is not None


# -- the cache ---------------------------------------------------------------------------------

def settings_key(config: TrainConfig, hf_config: Any, cap: int | None, device: str) -> str:
    """What makes trial times comparable: the model's shape, the data's shape, the device and the cap."""
    shape_names = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "tie_word_embeddings", "num_local_experts", "n_embd", "n_layer")
    shape = {name: getattr(hf_config, name, None) for name in shape_names}
    run = resolve(config, hf_config, device)  # what runs (auto and bf16 that both run bf16 share their trials)
    settings = {
        "shape": shape, "seq_len": config.data.seq_len, "effective_batch": config.effective_batch_for(1),
        "precision": run.autocast or "fp32", "dtype": config.model.dtype, "attention": run.attention,
        "packing": config.data.packing, "task": getattr(config, "task", None) and str(config.task),
        "cap": cap, "device": calibration.device_key(device),
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]


def candidate_key(plan: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in sorted(plan.items()) if k not in SKIPPED_KEYS}, sort_keys=True, default=str)


def cached_trials(key: str) -> dict[str, dict[str, Any]]:
    return calibration.read_cache().get("trials", {}).get(key, {})


def store_trials(key: str, trials: list[Trial]) -> None:
    measured = [t for t in trials if t.status == "measured" or t.status == "over cap"]
    if not measured:
        return

    def change(data: dict[str, Any]) -> None:
        entry = data.setdefault("trials", {}).setdefault(key, {})
        for trial in measured:
            entry[candidate_key(trial.plan)] = {"measured_seconds": trial.measured_seconds,
                                                "peak_bytes": trial.peak_bytes, "status": trial.status,
                                                "time": round(time.time())}

    calibration.update_cache(change)


# -- deciding --------------------------------------------------------------------------------

def trials_wanted(config: TrainConfig) -> str | None:
    """Why no trials run for `config` (None: they may)."""
    import os

    if not config.memory.trial:
        return "--no-trial"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "several ranks (trials time one process)"
    if config.output.resume:
        return "a resumed run keeps its plan"
    return None


def probe_scale(device: str) -> float:
    """What the speed model's seconds are multiplied by to be seconds on this device: 1 where this device
    calibrated it (or a GPU preset rated it), else the model's nominal rate over a matmul probe's."""
    if device != "cpu" or calibration.calibrated(device):
        return 1.0
    from memfit.models.flops import device_peak
    from memfit.prediction.speed_model import CPU_PROBE_UTILISATION, NOMINAL_TFLOPS, UTILISATION

    peak = device_peak(torch.device("cpu"), torch.float32).flops_per_second
    return NOMINAL_TFLOPS * 1e12 * UTILISATION / max(peak * CPU_PROBE_UTILISATION, 1.0)


def with_trials(config: TrainConfig, result: Any, hf_config: Any = None) -> tuple[TrainConfig, list[Trial], str]:
    """`config` with the fastest measured of the plan's ranked configurations applied, the trials, and why.

    `config` already carries the planner's choice (result.plan); it comes back unchanged when no
    trial runs or the planner's first choice was also the fastest measured.
    """
    if not result.ranked or result.maximize:
        return config, [], "nothing to compare"
    reason = trials_wanted(config)
    if reason:
        log.info("memfit: trials skipped: %s", reason)
        return config, [], reason
    from memfit.models.presets import resolve_model_config

    hf_config = hf_config or resolve_model_config(config.model.model, config.model.trust_remote_code)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cap = config.memory.memory_cap or result.budget_bytes
    key = settings_key(config, hf_config, cap, device)
    cached = cached_trials(key)
    scale = probe_scale(device)
    trials = [Trial(dict(r["plan"]), r["step_seconds"] * scale, r["estimated_peak_bytes"])
              for r in diverse(comparable(result.ranked))[:MAX_TRIALS]]
    for trial in trials:
        hit = cached.get(candidate_key(trial.plan))
        if hit:
            trial.measured_seconds, trial.peak_bytes = hit["measured_seconds"], hit["peak_bytes"]
            trial.status = "cached" if hit["status"] == "measured" else hit["status"]
    _skip_predicted_slower(trials)
    steps = config.training.max_steps if config.training.epochs is None else 10**6
    budget = TRIAL_SHARE * steps * trials[0].predicted_seconds
    to_run = [t for t in trials if t.status == "not run"]
    if to_run:
        cost = [_trial_cost_guess(t, config) for t in to_run[:2]]
        if len(trials) - len(to_run) < 2 and sum(cost) > budget:
            log.info("memfit: trials skipped: the run is too short to repay them (about %.1f s for two against"
                     " %.0f%% of its predicted %.1f s)", sum(cost), 100 * TRIAL_SHARE, steps * trials[0].predicted_seconds)
            return _chosen(config, result, trials, key, "too short to repay trials")
        log.info("memfit: trials: timing up to %d configurations within %.1f s (%.0f%% of the run's predicted %.1f s)",
                 len(to_run), budget, 100 * TRIAL_SHARE, steps * trials[0].predicted_seconds)
        _run_trials(config, to_run, cap, budget)
        store_trials(key, trials)
        _calibrate_from(trials, config, device, scale)
    else:
        log.info("memfit: trials: all %d configurations measured before on this device (cached)", len(trials))
    return _chosen(config, result, trials, key, None)


def _skip_predicted_slower(trials: list[Trial]) -> None:
    """A configuration measured before sets the bar: the ones not measured yet are timed only where the (by then
    calibrated) speed model expects them to beat it, so a second run whose ranking moved starts at once."""
    known = [t.measured_seconds for t in trials if t.usable]
    if not known:
        return
    slower = [t for t in trials if t.status == "not run" and t.predicted_seconds >= min(known)]
    for trial in slower:
        trial.status = SLOWER_THAN_MEASURED
    if slower:
        log.info("memfit: trials: %d configuration(s) not timed: predicted slower than the fastest measured before"
                 " (%.3g s/step)", len(slower), min(known))


def comparable(ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranked plans a measured time may choose between: the planner's first, and those its preferences
    rank beside it (no small-state optimizer after an exact one, no bf16 weights after fp32 ones: those
    the planner picks only for memory or for a large predicted gain, never for a few measured percent)."""
    from memfit.models.optimizer_state import PLANNING

    first = ranked[0]["plan"]

    def family(plan: dict[str, Any]) -> tuple[bool, bool]:
        return plan.get("optimizer") in PLANNING, plan.get("dtype") == "bf16" and not plan.get("lora_r")

    return [r for r in ranked if family(r["plan"]) <= family(first) and
            all(a <= b for a, b in zip(family(r["plan"]), family(first), strict=True))]


def diverse(ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`ranked` with the best of each shape (micro-batch, checkpointing, in backward, precision, dtype, compile)
    first, in rank order, and the rest after: the trials' few slots go to plans whose speed differs, not to one
    plan's loss-chunk variants (which run at its speed, and over the cap where it does)."""
    return shapes_first(ranked)


def _trial_cost_guess(trial: Trial, config: TrainConfig, build_seconds: float = BUILD_SECONDS_GUESS) -> float:
    """Seconds a trial takes: its session's build, and its steps' micro-batches (trial_steps.time_steps: 3 of
    one micro-batch, 6 where the plan accumulates) at the predicted rate."""
    accumulation = trial.plan.get("gradient_accumulation_steps", 1)
    micro_batches = 3 * min(accumulation, 2)
    return build_seconds + trial.predicted_seconds * micro_batches / accumulation


def _chosen(config: TrainConfig, result: Any, trials: list[Trial], key: str,
            skipped: str | None) -> tuple[TrainConfig, list[Trial], str]:
    usable = [t for t in trials if t.usable]
    result.trials = [asdict(t) for t in trials]
    if skipped or not usable:
        why = skipped or "no trial measured a configuration that fits: the speed model's first choice"
        if not skipped:
            _log_table(trials, None, why)
        return config, trials, why
    best = min(usable, key=lambda t: t.measured_seconds)
    first = trials[0]
    if best is first:
        why = f"the speed model's first choice was also the fastest measured ({best.measured_seconds:.3g} s/step)"
    else:
        first_text = (f"{first.measured_seconds:.3g} s/step measured" if first.usable else f"its trial: {first.status}")
        why = (f"fastest measured: {best.measured_seconds:.3g} s/step against the speed model's first choice"
               f" ({first_text})")
        changes = {**best.plan, "compile": first.plan.get("compile", resolve(config, None, "cpu").compiled)}
        config = config.replace(**{k: v for k, v in changes.items() if k in config.flat()})
        result.plan = {"seq_len": config.data.seq_len, **best.plan}
        result.estimated_peak_bytes = best.estimated_peak_bytes
        result.chosen_by = "trials"
    _log_table(trials, best, why)
    return config, trials, why


def _log_table(trials: list[Trial], best: Trial | None, why: str) -> None:
    for rank, trial in enumerate(trials, 1):
        log.info("memfit: trial %d%s %s", rank, " *" if trial is best else "  ", describe_trial(trial))
    log.info("memfit: trials: %s", why)


def describe_trial(trial: Trial | dict[str, Any]) -> str:
    """One line: the configuration, predicted and measured step time and peak, and what became of it."""
    t = trial if isinstance(trial, dict) else asdict(trial)
    plan = t["plan"]
    shape = (f"micro-batch {plan.get('batch_size')} x {plan.get('gradient_accumulation_steps')}, checkpointing"
             f" {plan.get('gradient_checkpointing')}, {plan.get('optimizer')}, precision {plan.get('precision')}"
             f"{', loss chunk ' + str(plan['loss_chunk_size']) if plan.get('loss_chunk_size') else ''}"
             f"{', dtype ' + plan['dtype'] if plan.get('dtype') not in (None, 'fp32') else ''}"
             f"{', optimizer in backward' if plan.get('optimizer_in_backward') else ''}"
             f"{', LoRA r' + str(plan['lora_r']) if plan.get('lora_r') else ''}")
    measured = f"{t['measured_seconds']:.3g} s" if t.get("measured_seconds") else "-"
    peak = format_bytes(t["peak_bytes"]) if t.get("peak_bytes") else "-"
    return (f"{shape}: predicted {t['predicted_seconds']:.3g} s/step, peak {format_bytes(t['estimated_peak_bytes'])};"
            f" measured {measured}, peak {peak} ({t['status']})")


# -- running -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _rng_kept():
    """Every random number generator the run draws from, as it was before the trials."""
    state = (random.getstate(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:
        numpy = numpy_state = None
    try:
        yield
    finally:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
        if state[2] is not None:
            torch.cuda.set_rng_state_all(state[2])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def _quiet():
    """The trial sessions' own build lines stay out of the run's log (their outcome is logged)."""
    logger = logging.getLogger("memfit")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING + 1))
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_trials(config: TrainConfig, trials: list[Trial], cap: int | None, budget: float) -> None:
    started = time.perf_counter()
    build_seconds = None
    with _rng_kept():
        for index, trial in enumerate(trials):
            spent = time.perf_counter() - started
            guess = _trial_cost_guess(trial, config, BUILD_SECONDS_GUESS if build_seconds is None else build_seconds)
            if index >= 2 and spent + guess > budget:
                log.info("memfit: trials: stopped after %d (%.1f s spent of %.1f s)", index, spent, budget)
                break
            build_seconds = time_trial(config, trial, cap) or build_seconds


def trial_config(config: TrainConfig, plan: dict[str, Any], cap: int | None) -> TrainConfig:
    """The configuration a trial runs: the plan, eager, its cap, no OOM recovery, no planning again."""
    changes = {k: v for k, v in plan.items() if k in config.flat() and k not in SKIPPED_KEYS}
    return config.replace(**changes, memory_budget=None, gpu=None, compile=False, memory_cap=cap,
                          oom_recovery=False, auto_batch_size=False, trial=False, report=False)


def time_trial(config: TrainConfig, trial: Trial, cap: int | None) -> float | None:
    """Run `trial` and fill in its measured step time and peak, or why it was dropped; returns the
    seconds its session took to build (None when it did not get that far)."""
    from memfit.train.setup import build_session

    built = time.perf_counter()
    session = None
    try:
        with _quiet():
            session = build_session(trial_config(config, trial.plan, cap))
        build_seconds = time.perf_counter() - built
        trial.measured_seconds, trial.peak_bytes = time_steps(session, cap)
        trial.status = "measured"
    except Exception as error:  # a trial never stops the run: it is dropped and the next one taken
        if is_out_of_memory(error):
            trial.status = "over cap"
        else:
            trial.status = f"failed: {type(error).__name__}: {str(error).strip()[:120]}"
        log.info("memfit: trial dropped (%s): %s", trial.status, describe_trial(trial))
        build_seconds = None
    finally:
        if session is not None and session.device.type == "cuda":
            from memfit.memory.cap import apply_memory_cap

            apply_memory_cap(session.device, config.memory.memory_cap)  # the run's own cap (None: none)
        del session
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return build_seconds


def _calibrate_from(trials: list[Trial], config: TrainConfig, device: str, scale: float) -> None:
    """Each measured trial becomes a calibration point: its eager time against the model's own eager figure."""
    from memfit.prediction.speed_model import COMPILED_BLOCKS_SPEEDUP, compute_dtype

    points = []
    for trial in trials:
        if trial.status != "measured":
            continue
        compute = compute_dtype(trial.plan, config, device)
        model_seconds = trial.predicted_seconds / scale / calibration.correction(trial.plan, config, device, compute)
        if trial.plan.get("compile"):
            model_seconds *= COMPILED_BLOCKS_SPEEDUP.get(device, 1.0)
        eager = {**trial.plan, "compile": False}
        points.append((calibration.features(eager, config, compute), model_seconds, trial.measured_seconds))
    if points:
        calibration.record_points(device, points, "trial")


def plan_trials_record(trials: list[Trial], why: str, chosen_by: str) -> dict[str, Any]:
    """The metrics.jsonl line that says what the trials measured and what won."""
    return {"event": "plan_trials", "chosen_by": chosen_by, "why": why,
            "candidates": [asdict(t) if isinstance(t, Trial) else t for t in trials]}


def trial_then_record(config: TrainConfig, result: Any) -> TrainConfig:
    """`with_trials`, then the plan_trials line at the head of the run's metrics (when any trial was shown)."""
    config, trials, why = with_trials(config, result)
    if trials:
        from pathlib import Path

        from memfit.train.metrics import JsonlLogger

        if result.chosen_by == "trials":
            log.info("memfit: trials chose: %s", " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in result.plan.items() if k != "seq_len"))
        path = Path(config.output.log_file) if config.output.log_file else Path(config.output.output_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        logger = JsonlLogger(path)
        logger.log(plan_trials_record(trials, why, result.chosen_by))
        logger.close()
    return config


def attach_cached(config: TrainConfig, result: Any) -> None:
    """`memfit plan`: fill `result.trials` with what earlier trials on this device measured of its ranked
    plans (nothing is run; plans never measured show the prediction only)."""
    if not result.ranked or result.maximize:
        return
    try:
        from memfit.models.presets import resolve_model_config

        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    except Exception:  # the plan itself resolved it; a failure here only hides the measurements
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cached = cached_trials(settings_key(config, hf_config, config.memory.memory_cap or result.budget_bytes, device))
    if not cached:
        return
    shown = []
    for r in diverse(comparable(result.ranked))[:MAX_TRIALS]:
        trial = Trial(dict(r["plan"]), r["step_seconds"], r["estimated_peak_bytes"])
        hit = cached.get(candidate_key(trial.plan))
        if hit:
            trial.measured_seconds, trial.peak_bytes, trial.status = hit["measured_seconds"], hit["peak_bytes"], (
                "cached" if hit["status"] == "measured" else hit["status"])
        shown.append(asdict(trial))
    result.trials = shown

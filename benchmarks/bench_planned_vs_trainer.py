"""memfit's planned run (trials included) against the fastest Hugging Face Trainer setting that fits, and the
speed model's rank correlation with measured step times before and after calibration.

    python benchmarks/bench_planned_vs_trainer.py                       # the bench model, 12-step runs, 2 CPU cores
    python benchmarks/bench_planned_vs_trainer.py --isa AVX2 --isa default --isa aten-default
    python benchmarks/bench_planned_vs_trainer.py --quick               # smoke test: a toy model, a few steps
    python benchmarks/bench_planned_vs_trainer.py --out docs/benchmarks.md

The bench model is Llama-shaped: 8 blocks of width 256 (4 heads, MLP 688), the byte tokenizer's
257-token vocabulary, random weights saved once; seq 512, 8 samples per optimizer step.

- Budget: half the plain run's tracked peak (memfit's tracker: live tensor bytes, the quantity
  `--memory-cap` limits) of the Trainer at micro-batch 8, fp32.
- Trainer: every setting of micro-batch (8, 4, 2, 1, accumulation keeping 8 samples),
  gradient_checkpointing and bf16 is run (bench_peers.py's worker: the same samples in the same
  order, a tracker over the warm-up steps); the fastest whose tracked peak fits wins.
- memfit: `--memory-budget` planned in a fresh process with an empty cache (`MEMFIT_CACHE_DIR`),
  trials included (their share of the run's time unbounded so that a 12-step run times them: at the
  default 10 % a run this short skips them), then the same again with the cache the first run left (what a second run
  sees: no trials), and once more with an empty cache and the default trial share (what a user's run
  does: a 12-step run skips trials it cannot repay, and its log says so). Per step: the median of the
  steps after the first; whole run: from the start of planning to the end of the last step, the
  process's imports done before the clock starts; the Trainer's: from its model load to the start of its
  training, then each step at its steady time (its imports left out too). memfit's peak is the chosen plan's trial peak (tracked under
  the cap).
- Rank correlation: Spearman's rho between the speed model's predicted step times and the trials'
  measured ones over the candidates, before calibration, after it (the model refitted with all
  trials, in sample) and leave-one-out (each candidate predicted from the others' measurements),
  for each `--isa` (`AVX2`: ONEDNN_MAX_CPU_ISA=AVX2; `aten-default`: ATEN_CPU_CAPABILITY=default).

Each run is a fresh process (a worker of this script or of bench_peers.py). `--quick` runs them all in this
script's process instead, each run still its own call of the same worker with its own environment variables
(the default ISA only): it checks that every step runs, not how fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    emit_result,
    environment,
    machine_description,
    markdown_table,
    median,
    run_worker,
    today,
    write_section,
)

SECTION = "Planned run with trials against the Trainer's best setting"
MIB = 1024**2
SHAPES = {
    "bench": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 4},
    "quick": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2},
}
ISA_ENV = {"default": {}, "AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "aten-default": {"ATEN_CPU_CAPABILITY": "default"}}


def save_bench_model(directory: Path, shape: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    config = LlamaConfig(**SHAPES[shape], vocab_size=257, max_position_embeddings=2048, bos_token_id=256,
                         eos_token_id=256, pad_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        k = 0
        while k < len(order):  # ties share their mean rank
            j = k
            while j + 1 < len(order) and values[order[j + 1]] == values[order[k]]:
                j += 1
            for m in range(k, j + 1):
                out[order[m]] = (k + j) / 2
            k = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    norm = math.sqrt(sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb))
    return cov / norm if norm else None


# ---------------------------------------------------------------------------
# The memfit worker (a fresh process)
# ---------------------------------------------------------------------------


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from memfit.train import trials

    share = trials.TRIAL_SHARE
    if spec["trial_share"] is not None:  # None: the default share, as a user's run has it
        trials.TRIAL_SHARE = spec["trial_share"]
    shown: dict[str, Any] = {}
    original = trials.with_trials

    def keep(config, result, hf_config=None):
        out = original(config, result, hf_config)
        shown.update(trials=out[1], why=out[2], result=result)
        return out

    trials.with_trials = keep
    try:
        return _memfit_run(spec, shown)
    finally:  # --quick runs every worker in one process: the next one wraps the original again
        trials.with_trials, trials.TRIAL_SHARE = original, share


def _memfit_run(spec: dict[str, Any], shown: dict[str, Any]) -> dict[str, Any]:
    from memfit.config_loading import load_config
    from memfit.prediction import calibration
    from memfit.prediction.speed_model import compute_dtype
    from memfit.train import trials
    from memfit.train.loop import train
    from memfit.train.planned import apply_plan_if_asked

    config = load_config(overrides={k: str(v) for k, v in {
        "model": spec["model_dir"], "cache_dir": spec["cache_dir"], "seq_len": spec["seq_len"],
        "batch_size": spec["effective_batch"], "max_steps": spec["steps"], "memory_budget": spec["budget"],
        "output_dir": spec["output_dir"], "log_every": 10**6, "report": False}.items()})
    # The process's imports before the clock, as the Trainer's start-up is left out: the model's code and
    # memfit's planner (its first import is most of a warm plan's seconds on this CPU)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import memfit.prediction.planner  # noqa: F401

    started = time.perf_counter()
    planned = apply_plan_if_asked(config)
    planned_at = time.perf_counter()
    result = train(planned)
    ended = time.perf_counter()
    steps = [json.loads(line) for line in (Path(spec["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    step_tokens = [r["tokens"] for r in steps if "event" not in r and "step" in r]
    tokens_per_second = [r["tokens_per_second"] for r in steps if "event" not in r and "step" in r]
    step_seconds = [t / s for t, s in zip(step_tokens, tokens_per_second, strict=True)]
    done = shown.get("trials") or []
    measured = [t for t in done if t.status in ("measured", "cached") and t.measured_seconds]
    correlation: dict[str, Any] = {}
    if len(measured) >= 3:
        device = "cpu"
        before = [t.predicted_seconds for t in measured]
        truth = [t.measured_seconds for t in measured]
        feats = [calibration.features({**t.plan, "compile": False}, planned, compute_dtype(t.plan, planned, device))
                 for t in measured]
        scale = trials.probe_scale(device)
        model_seconds = [t.predicted_seconds / scale for t in measured] if spec["cold"] else None
        if model_seconds:
            points = [{"features": f, "log_ratio": math.log(m / s)}
                      for f, s, m in zip(feats, model_seconds, truth, strict=True)]

            def predict(weights: dict[str, float], f: dict[str, float], s: float) -> float:
                return s * math.exp(sum(weights.get(k, 0.0) * v for k, v in f.items()))

            in_sample = calibration.fit(points)
            after = [predict(in_sample, f, s) for f, s in zip(feats, model_seconds, strict=True)]
            loo = [predict(calibration.fit(points[:i] + points[i + 1:]), feats[i], model_seconds[i])
                   for i in range(len(points))]
            correlation = {"before": spearman(before, truth), "after": spearman(after, truth),
                           "leave_one_out": spearman(loo, truth), "candidates": len(measured)}
    chosen = next((t for t in done if t.status in ("measured", "cached") and
                   t.plan.get("batch_size") == planned.training.batch_size and
                   t.plan.get("gradient_checkpointing") == planned.memory.gradient_checkpointing), None)
    return {
        "step_seconds": median(step_seconds[1:]),
        "whole_run_seconds": ended - started,
        "planning_and_trials_seconds": planned_at - started,
        "train_seconds": ended - planned_at,
        "trials": [{"plan": t.plan, "predicted_seconds": t.predicted_seconds, "measured_seconds": t.measured_seconds,
                    "peak_bytes": t.peak_bytes, "status": t.status} for t in done],
        "why": shown.get("why"),
        "chosen_by": getattr(shown.get("result"), "chosen_by", None),
        "tracked_peak_bytes": chosen.peak_bytes if chosen else None,
        "ran": {"batch_size": planned.training.batch_size,
                "gradient_accumulation_steps": planned.training.gradient_accumulation_steps,
                "gradient_checkpointing": planned.memory.gradient_checkpointing,
                "precision": planned.memory.precision, "optimizer": planned.optimizer.optimizer,
                "loss_chunk_size": planned.memory.loss_chunk_size,
                "optimizer_in_backward": planned.memory.optimizer_in_backward},
        "correlation": correlation,
        "first_loss": result.losses[0],
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["kind"] == "memfit-planned":
        return memfit_worker(spec)
    import bench_peers

    return bench_peers.hf_worker(spec)


def _timed_worker(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    result = _worker(spec)
    return {**result, "seconds": time.perf_counter() - started}


def _in_this_process(job: dict[str, Any]) -> dict[str, Any]:
    """--quick: one job in this process, its environment (the cache directory, no GPU) set around it only."""
    with environment(job["env"]):
        return _timed_worker(job["spec"])


def _trainer_settings(effective: int, bf16: bool) -> list[tuple[str, dict[str, Any]]]:
    settings = []
    for micro in (m for m in (8, 4, 2, 1) if effective % m == 0 and m <= effective):
        for checkpointing in (False, True):
            for half in ((False, True) if bf16 else (False,)):
                settings.append((f"Trainer bs {micro} x {effective // micro}{', checkpointing' if checkpointing else ''}"
                                 f"{', bf16' if half else ', fp32'}",
                                 {"batch_size": micro, "gradient_checkpointing": checkpointing, "bf16": half,
                                  "optim": "adamw_torch_fused"}))
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="toy model, 4 steps, two Trainer settings (smoke test)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--isa", action="append", choices=list(ISA_ENV), help="ISAs for the rank correlation")
    parser.add_argument("--no-bf16", action="store_true", help="leave bf16 out of the Trainer's grid")
    parser.add_argument("--json", help="write every run's raw result here")
    parser.add_argument("--out", help="write the section into this markdown file")
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(_worker(json.loads(args.worker)))
        return 0
    shape = "quick" if args.quick else "bench"
    steps = 4 if args.quick else args.steps
    seq_len, effective = (64, 4) if args.quick else (512, 8)
    isas = args.isa or (["default"] if args.quick else ["default", "AVX2", "aten-default"])
    if args.quick and any(ISA_ENV[isa] for isa in isas):  # read by torch as it loads, so only in a fresh process
        parser.error("--quick runs every job in this process, on its default ISA: leave --isa out or drop --quick")
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memfit-bench-planned-") as tmp:
        work = Path(tmp)
        params = save_bench_model(work / "model", shape)
        count = [0]

        def hf(label: str, knobs: dict[str, Any]) -> dict[str, Any]:
            count[0] += 1
            spec = {"kind": "hf", "name": label, "model_dir": str(work / "model"), "cache_dir": str(work / "cache"),
                    "output_dir": str(work / f"run-{count[0]}"), "steps": 3 if args.quick else 4, "warmup": 1,
                    "seq_len": seq_len, "effective_batch": effective, "device": "cpu", "overrides": knobs,
                    "track": True}
            return {"label": label, "number": count[0], "spec": spec, "env": {"CUDA_VISIBLE_DEVICES": ""}}

        def planned(label: str, budget: int, cache: Path, isa: str, cold: bool, share: float) -> dict[str, Any]:
            count[0] += 1
            spec = {"kind": "memfit-planned", "model_dir": str(work / "model"), "cache_dir": str(work / "cache"),
                    "seq_len": seq_len, "effective_batch": effective, "steps": steps, "budget": budget,
                    "output_dir": str(work / f"run-{count[0]}"), "trial_share": share, "cold": cold}
            env = {"CUDA_VISIBLE_DEVICES": "", "MEMFIT_CACHE_DIR": str(cache), **ISA_ENV[isa]}
            return {"label": label, "number": count[0], "spec": spec, "env": env, "isa": isa}

        def record(job: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
            label = job["label"]
            if job["spec"]["kind"] == "hf":
                result.update(label=label, kind="hf")
                raw.append(result)
                print(f"[{job['number']}] {label}: {result['tokens_per_second']:.0f} tokens/s, tracked"
                      f" {result['tracked_peak_bytes'] / MIB:.0f} MiB", file=sys.stderr)
                return result
            result.update(label=label, kind="memfit", isa=job["isa"])
            raw.append(result)
            print(f"[{job['number']}] {label}: {result['step_seconds']:.3f} s/step, whole run"
                  f" {result['whole_run_seconds']:.1f} s ({result['chosen_by']}: {result['why']})", file=sys.stderr)
            if args.json:
                Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
            return result

        def run(*jobs: dict[str, Any]) -> list[dict[str, Any]]:
            """Each job in a fresh process; with --quick, all of them in this one (the default ISA only)."""
            if args.quick:
                return [record(job, _in_this_process(job)) for job in jobs]
            out = []
            for job in jobs:
                started = time.perf_counter()
                result = run_worker(__file__, job["spec"], timeout=1800, env=job["env"])
                if job["spec"]["kind"] == "hf":
                    result["seconds"] = time.perf_counter() - started
                out.append(record(job, result))
            return out

        plain_job = hf(f"Trainer plain (bs {effective} x 1, fp32)", {"batch_size": effective, "bf16": False,
                                                                     "optim": "adamw_torch_fused"})
        grid = _trainer_settings(effective, not args.no_bf16)
        if args.quick:  # the plain run with the grid's last two settings: the budget needs only the plain run's peak
            grid = grid[-2:]
            plain, *tried = run(plain_job, *(hf(label, knobs) for label, knobs in grid))
        else:
            (plain,) = run(plain_job)
        budget = int(plain["tracked_peak_bytes"] * 0.5)
        memfit_jobs: list[tuple[str, dict[str, Any]]] = []  # memfit first: a broken run shows before the grid's time
        for isa in isas:
            cache = work / f"cache-{isa}"
            memfit_jobs.append((isa, planned(f"memfit planned, {isa} ISA, empty cache (trials run)", budget, cache,
                                             isa, True, 1e6)))
            if isa == isas[0]:
                memfit_jobs.append(("user", planned(f"memfit planned, {isa} ISA, empty cache, default trial share",
                                                       budget, work / "cache-default-share", isa, True, None)))
                memfit_jobs.append(("warm", planned(f"memfit planned, {isa} ISA, cache from the run before", budget,
                                                    cache, isa, False, 1e6)))
        if not args.quick:
            runs = dict(zip([key for key, _ in memfit_jobs], run(*(job for _, job in memfit_jobs)), strict=True))
            tried = run(*(hf(label, knobs) for label, knobs in grid))
        fitting = [r for r in tried if r["tracked_peak_bytes"] <= budget]
        best = max(fitting, key=lambda r: r["tokens_per_second"]) if fitting else None
        again_job = [hf(f"{best['label']} (again, after memfit)", best["ran"])] if best else []
        if args.quick:  # memfit's runs and the Trainer's repeat after the grid
            results = run(*(job for _, job in memfit_jobs), *again_job)
            runs = dict(zip([key for key, _ in memfit_jobs], results[:len(memfit_jobs)], strict=True))
            again = results[len(memfit_jobs)] if best else None
        else:
            again = run(*again_job)[0] if best else None
    cold, warm, default = runs[isas[0]], runs["warm"], runs["user"]
    rows = []
    for r in [plain, *tried, *([again] if again else [])]:
        rows.append([r["label"] + (" **(fastest that fits)**" if r is best else ""),
                     f"{8 * seq_len / r['tokens_per_second'] if effective == 8 else effective * seq_len / r['tokens_per_second']:.3f}",
                     f"{r['tracked_peak_bytes'] / MIB:.0f}", "yes" if r["tracked_peak_bytes"] <= budget else "no"])
    for r in (cold, default, warm):
        peak = r["tracked_peak_bytes"]
        rows.append([f"{r['label']} ({_ran(r['ran'])}; whole run {r['whole_run_seconds']:.1f} s, of which planning"
                     f" and trials {r['planning_and_trials_seconds']:.1f} s)", f"{r['step_seconds']:.3f}",
                     "-" if peak is None else f"{peak / MIB:.0f}",
                     "-" if peak is None else ("yes" if peak <= budget else "no")])
    table = markdown_table(["run", "s per optimizer step (after the first)", "tracked peak (MiB)",
                            f"fits {budget / MIB:.0f} MiB"], rows)
    if best:
        trainer_step = effective * seq_len / (sum(r["tokens_per_second"] for r in (best, again)) / 2)
        # The Trainer's whole run as memfit's is timed (model load to the last step, imports before the clock): its
        # own start-up (model load, arguments, Trainer) measured, then every step at its steady time (its first
        # step's extra cost left out, which favours the Trainer; its warm-up steps ran under the tracker)
        trainer_setup = sum(r.get("setup_seconds", 0.0) for r in (best, again)) / 2
        trainer_whole = trainer_setup + steps * trainer_step
        headline = (f"Budget {budget / MIB:.0f} MiB of live tensors (half the plain run's tracked peak,"
                    f" {plain['tracked_peak_bytes'] / MIB:.0f} MiB). Per step: memfit"
                    f" **{trainer_step / cold['step_seconds']:.2f}x** the speed of the Trainer's fastest setting that"
                    f" fits ({best['label']}, mean of its two runs: {trainer_step:.3f} s); whole {steps}-step run as a"
                    f" user runs it (default trial share: {default['why']}):"
                    f" **{trainer_whole / default['whole_run_seconds']:.2f}x** ({default['whole_run_seconds']:.1f} s"
                    f" from planning to the last step against the Trainer's {trainer_setup:.1f} s from its model load to"
                    f" its first step and {steps} x {trainer_step:.3f} s of steps, both processes' imports left out);"
                    f" with every trial run: {trainer_step / cold['step_seconds']:.2f}x"
                    f" per step, {trainer_whole / cold['whole_run_seconds']:.2f}x whole run;"
                    f" with the cache of the first run: {trainer_step / warm['step_seconds']:.2f}x"
                    f" per step, {trainer_whole / warm['whole_run_seconds']:.2f}x whole run.")
    else:
        headline = f"No Trainer setting fits {budget / MIB:.0f} MiB."
    corr_rows = []
    for isa in isas:
        c = runs[isa]["correlation"]
        corr_rows.append([isa, str(c.get("candidates", "-")), _rho(c.get("before")), _rho(c.get("after")),
                          _rho(c.get("leave_one_out"))])
    corr = markdown_table(["ISA", "candidates timed", "rho before calibration", "rho after (in sample)",
                           "rho leave-one-out"], corr_rows)
    trial_rows = [[_ran(t["plan"]), f"{t['predicted_seconds']:.3f}",
                   "-" if not t["measured_seconds"] else f"{t['measured_seconds']:.3f}",
                   "-" if not t["peak_bytes"] else f"{t['peak_bytes'] / MIB:.0f}", t["status"]] for t in cold["trials"]]
    trial_table = markdown_table(["candidate (default ISA)", "predicted s/step", "measured s/step", "trial peak (MiB)",
                                  "status"], trial_rows)
    body = (f"Command: `python benchmarks/bench_planned_vs_trainer.py{' --quick' if args.quick else ''}`;"
            f" {today()}; {machine_description('cpu')}; load average at the end {os.getloadavg()[0]:.1f};"
            f" model: Llama-shaped, {SHAPES[shape]['num_hidden_layers']} blocks of width {SHAPES[shape]['hidden_size']},"
            f" {params / 1e6:.1f}M parameters, byte vocabulary; seq {seq_len}, {effective} samples per step,"
            f" {steps} steps.\n\n{headline}\n\n{table}\n\nmemfit's trials (the first run):\n\n{trial_table}\n\n"
            f"Speed model against the trials' measured step times (Spearman's rho):\n\n{corr}\n")
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
    return 0


def _rho(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ran(plan: dict[str, Any]) -> str:
    parts = [f"{plan.get('batch_size')} x {plan.get('gradient_accumulation_steps')}",
             f"checkpointing {plan.get('gradient_checkpointing')}", str(plan.get("optimizer") or "adamw")]
    if plan.get("precision") not in (None, "auto", "fp32"):
        parts.append(str(plan["precision"]))
    if plan.get("loss_chunk_size"):
        parts.append(f"loss chunk {plan['loss_chunk_size']}")
    if plan.get("optimizer_in_backward"):
        parts.append("optimizer in backward")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())

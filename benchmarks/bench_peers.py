"""memfit against Hugging Face Trainer: the same config on a bigger model (P1), the same memory budget (P2), and a GPU run.

    python benchmarks/bench_peers.py p1                        # Qwen2.5-0.5B shape, random init, seq 512, CPU
    python benchmarks/bench_peers.py p1 --layers 6             # the same width and vocabulary, 6 of its 24 blocks
    python benchmarks/bench_peers.py p2                        # 20M Llama (32000 vocabulary), seq 512, 8 samples per step
    python benchmarks/bench_peers.py gpu                       # Llama-3.2-1B shape, bf16, seq 2048 (needs CUDA)
    python benchmarks/bench_peers.py p1 --out docs/benchmarks.md

P1, same config: both tools train the same randomly initialised model (saved once with a
fixed seed, loaded by both) on the same samples in the same order, fp32, fused AdamW,
clipping at 1, cosine schedule, SDPA attention; memfit with its defaults otherwise.
Reported: tokens/s and peak RSS of memfit as ratios to the Trainer, in one run.

P2, same memory budget: both tools' peaks are counted by one counter, memfit's
`MemoryTracker` (live tensor storages on the device, the quantity `--memory-cap` limits;
the process's RSS also holds the interpreter, the libraries and the allocator's cache,
which no training setting changes). The budget is half of the plain Trainer run's
tracked peak. The Trainer gets the fastest of its own settings whose tracked peak fits:
micro-batch and accumulation (same samples per step), `gradient_checkpointing`,
`optim="adamw_8bit"` and `bf16` (each setting is run and measured). memfit gets the
budget as `--memory-budget` (its planner picks micro-batch, checkpointing, chunked loss,
8-bit AdamW, ...) and `--memory-cap` (enforced by the tracker); both run bf16 autocast.
The tracker costs a Python call per operator, so it runs during the warm-up steps only
and tokens/s comes from the untracked steps after them: the Trainer's tracker is entered
at the first step and left after the last warm-up step; memfit's capped run tracks every
step, so its tokens/s comes from a second run of the same plan without the cap (the
planner is deterministic; a capped run that had to recover from out of memory is
flagged). Under the tracker torch.compile runs the blocks eager (Dynamo does not trace
under a Python dispatch mode), so a plan with `--compile` is capped and tracked in its
eager form; peak RSS shows the compiled run's. memfit plans a run of `--plan-steps`
(1000) steps, the length compile's one-off cost is weighed against, and trains the first
`--steps`. The Trainer's chosen setting runs once more after memfit, and memfit is
compared with the mean of its two runs. Reported: memfit's tokens per CPU second (the
process's CPU time, one thread: on a shared machine it leaves out the time other jobs
held the cores) and tokens/s over the Trainer's, both tracked peaks against the budget,
peak RSS as a secondary column, and with `--trainer-compile` the Trainer's setting with
`torch_compile=True` (informational: not tracked).

GPU: memfit plain, `--compile`, `--kernels liger` against the Trainer and the Trainer
with `use_liger_kernel=True`: tokens/s, MFU and peak allocated.

Clocks: tokens/s is the median over the steps after warm-up of (tokens of the step) /
(time from the end of the previous step to the end of this one), for both tools alike.
Peaks (P1, GPU; P2's secondary column): CPU: the process's peak resident memory (VmHWM) from the first step to the last,
reset when training starts (so model loading is out of it for both); CUDA:
`torch.cuda.max_memory_allocated` over the same span. Each run is a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    default_label,
    emit_result,
    machine_description,
    markdown_table,
    median,
    run_worker,
    synchronize,
    today,
)

SECTION = "Against Hugging Face Trainer: same config, same memory"
MIB = 1024**2
LR, BETAS, EPS, MAX_GRAD_NORM, SEED = 1e-3, (0.9, 0.95), 1e-8, 1.0, 0
EOS = 256  # the byte tokenizer's end-of-text id


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def save_preset_model(directory: Path, preset: str, layers: int | None) -> tuple[int, str]:
    """A random-init model of a memfit preset's shape (optionally fewer blocks), saved with the byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.models.presets import resolve_model_config
    from memfit.models.tiny import byte_tokenizer

    config = resolve_model_config(preset)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.bos_token_id = config.eos_token_id = config.pad_token_id = EOS
    config.max_position_embeddings = max(4096, config.max_position_embeddings)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    described = (f"{preset} shape ({config.num_hidden_layers} blocks of width {config.hidden_size},"
                 f" {config.num_attention_heads} heads / {config.num_key_value_heads} KV, MLP {config.intermediate_size},"
                 f" vocabulary {config.vocab_size}{', tied embeddings' if config.tie_word_embeddings else ''})")
    return sum(p.numel() for p in model.parameters()), described


# ---------------------------------------------------------------------------
# Workers (each in a fresh process)
# ---------------------------------------------------------------------------


def _rates(stamps: list[float], tokens: list[int], warmup: int) -> list[float]:
    return [tokens[k] / max(stamps[k + 1] - stamps[k], 1e-9) for k in range(warmup, len(tokens))]


def _cpu_clock() -> float:
    """CPU seconds of this process (all its threads), so a step's figure leaves out the time other jobs held the cores."""
    return time.process_time()


def _peak(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    from memfit.memory.stats import process_peak_rss_bytes

    return int(process_peak_rss_bytes() or 0)


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from memfit.config_loading import load_config
    from memfit.memory.stats import process_rss_bytes
    from memfit.train import metrics
    from memfit.train.loop import train
    from memfit.train.planned import apply_plan_if_asked

    device = spec["device"]
    base_rss = int(process_rss_bytes() or 0)
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    tokens: list[int] = []
    records: list[dict] = []
    peaks: list[int] = []
    original_log = metrics.JsonlLogger.log

    def log(self, record: dict[str, Any]) -> None:  # instrumentation only: stamp each step's end
        if record.get("event") == "start":
            stamps.append(time.perf_counter())
            cpu_stamps.append(_cpu_clock())
        elif "event" not in record and "step" in record:
            synchronize(device)
            stamps.append(time.perf_counter())
            cpu_stamps.append(_cpu_clock())
            tokens.append(int(record["tokens"]))
            records.append(record)
            peaks.append(int(record.get("peak_memory_bytes") or 0))
        original_log(self, record)

    metrics.JsonlLogger.log = log
    if spec.get("compile_loss"):
        # Experiment, not a memfit option: torch.compile memfit's loss function (the model's forward, the head and
        # the loss in one graph), to see what compiling more than the blocks would buy.
        import torch

        import memfit.train.step as step_module

        step_module.causal_lm_loss_sum = torch.compile(step_module.causal_lm_loss_sum)
    budget = spec.get("budget_bytes")
    overrides = {
        "model": spec["model_dir"], "seq_len": spec["seq_len"], "max_steps": spec["steps"], "seed": SEED,
        "lr": LR, "max_grad_norm": MAX_GRAD_NORM, "output_dir": spec["output_dir"], "cache_dir": spec["cache_dir"],
        "log_every": 10**6, "report": False, **spec["overrides"],
    }
    if budget:
        # The budget is in tracked live tensor bytes, the quantity the cap limits (see the docstring).
        overrides["memory_budget"] = budget
        if spec.get("cap"):
            overrides["memory_cap"] = budget
    elif spec.get("cap_bytes"):
        overrides["memory_cap"] = spec["cap_bytes"]  # a fixed setting under the cap, without planning
    config = load_config(overrides={k: str(v) for k, v in overrides.items()})
    # train() trains the config as given; `memfit train` plans first when a budget is set, and so does this run.
    # With plan_steps the plan is made for a run of that many steps (what compile's one-off cost is weighed
    # against), and the benchmark trains only its first `steps`.
    if budget and spec.get("plan_steps"):
        planned = apply_plan_if_asked(config.replace(max_steps=spec["plan_steps"])).replace(max_steps=spec["steps"])
    else:
        planned = apply_plan_if_asked(config)
    result = train(planned)
    warm = records[spec["warmup"]:]
    summary = result.summary
    rss = max(peaks) if peaks else None
    return {
        "tokens_per_second": median(_rates(stamps, tokens, spec["warmup"])),
        "tokens_per_cpu_second": median(_rates(cpu_stamps, tokens, spec["warmup"])),
        "peak_bytes": rss,
        "rss_peak_bytes": rss,
        "tracked_peak_bytes": summary.get("tracked_peak_bytes"),
        "oom_events": summary.get("oom_events") or 0,
        "base_rss_bytes": base_rss,
        "first_loss": result.losses[0],
        "mfu": median([r["mfu"] for r in warm if r.get("mfu") is not None]),
        "ran": {key: summary.get(key) for key in ("precision", "optimizer", "gradient_checkpointing", "loss_chunk_size",
                                                  "tiled_mlp", "optimizer_in_backward", "activation_offload",
                                                  "micro_batch_size", "effective_batch_size", "kernels", "compile")},
    }


def hf_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from memfit.config import DataConfig
    from memfit.data import BatchSchedule, collate, load_training_data
    from memfit.memory.stats import reset_peaks

    device = spec["device"]
    knobs = spec["overrides"]
    micro, accumulation = knobs.get("batch_size", spec["effective_batch"]), 1
    accumulation = spec["effective_batch"] // micro
    steps = spec["steps"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    windows = load_training_data(DataConfig(seq_len=spec["seq_len"], cache_dir=spec["cache_dir"]), tokenizer)
    schedule = BatchSchedule(len(windows), spec["effective_batch"], SEED)
    order = [int(i) for step in range(steps) for i in schedule.batch_indices(step)]

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(order)

        def __getitem__(self, index: int):
            return windows[order[index]]

    per_step = spec["effective_batch"]
    tokens = [sum(len(windows[i]["input_ids"]) for i in order[k * per_step:(k + 1) * per_step]) for k in range(steps)]
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    peak = [0]
    losses: list[float] = []
    # memfit's live-tensor counter over the warm-up steps (the budget's unit in P2); off afterwards, so the
    # steps that are timed run without its per-operator cost.
    tracker = None
    if spec.get("track"):
        from memfit.memory.tracker import MemoryTracker

        tracker = MemoryTracker(torch.device(device))

    class Stamps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            reset_peaks(torch.device(device))
            stamps.append(time.perf_counter())
            cpu_stamps.append(_cpu_clock())

        def on_step_begin(self, args, state, control, **kwargs):
            if tracker is not None and state.global_step == 0:
                tracker.attach(kwargs["model"], kwargs.get("optimizer"))
                tracker.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if tracker is not None and state.global_step == spec["warmup"]:
                tracker.__exit__(None, None, None)
                tracker.detach()
            synchronize(device)
            stamps.append(time.perf_counter())
            cpu_stamps.append(_cpu_clock())
            peak[0] = max(peak[0], _peak(device))

    class OrderedTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)  # already memfit's order

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    torch.manual_seed(SEED)
    setup_started = time.perf_counter()  # the Trainer's own start-up: model load, arguments, Trainer, data loader
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    on_cuda = device == "cuda"
    extra = {"use_liger_kernel": True} if knobs.get("liger") else {}
    arguments = TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM,
        optim=knobs.get("optim", "adamw_torch_fused"), bf16=bool(knobs.get("bf16", on_cuda)), use_cpu=not on_cuda,
        gradient_checkpointing=bool(knobs.get("gradient_checkpointing", False)),
        torch_compile=bool(knobs.get("torch_compile", False)),
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, seed=SEED, **extra,
    )
    del dtype
    trainer = OrderedTrainer(model=model, args=arguments, train_dataset=Samples(),
                             data_collator=lambda samples: collate(samples, tokenizer.pad_token_id), callbacks=[Stamps()])
    trainer.train()
    return {
        "tokens_per_second": median(_rates(stamps, tokens, spec["warmup"])),
        "tokens_per_cpu_second": median(_rates(cpu_stamps, tokens, spec["warmup"])),
        "setup_seconds": stamps[0] - setup_started,  # model load to the start of training
        "peak_bytes": peak[0],
        "rss_peak_bytes": peak[0],
        "tracked_peak_bytes": tracker.peak_bytes if tracker is not None else None,
        "first_loss": losses[0] if losses else None,
        "ran": dict(knobs),
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, device: str, workdir: Path, model_dir: Path):
        self.args, self.device, self.workdir, self.model_dir = args, device, workdir, model_dir
        self.count = 0
        self.raw: list[dict] = []

    def run(self, kind: str, label: str, overrides: dict[str, Any], budget: int | None = None, *, track: bool = False,
            cap: bool = False, cap_bytes: int | None = None, plan_steps: int | None = None) -> dict[str, Any]:
        self.count += 1
        spec = {
            "kind": kind, "name": label, "model_dir": str(self.model_dir), "cache_dir": str(self.workdir / "cache"),
            "output_dir": str(self.workdir / f"run-{self.count}"), "steps": self.args.steps, "warmup": self.args.warmup,
            "seq_len": self.args.seq_len, "effective_batch": self.args.effective_batch, "device": self.device,
            "overrides": overrides, "budget_bytes": budget, "track": track, "cap": cap,
            "cap_bytes": cap_bytes, "plan_steps": plan_steps,
        }
        if kind == "memfit" and overrides.get("compile_loss"):
            spec["compile_loss"] = True
        if kind == "memfit":
            spec["overrides"] = {"batch_size": self.args.effective_batch,
                                 **{k: v for k, v in overrides.items() if k != "compile_loss"}}
        env = {"CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else {}
        if self.args.threads:
            env["OMP_NUM_THREADS"] = str(self.args.threads)  # torch's CPU thread pool, the same for both tools
        started = time.perf_counter()
        result = run_worker(__file__, spec, timeout=3600, env=env)
        result.update(label=label, kind=kind, seconds=round(time.perf_counter() - started, 1))
        self.raw.append(result)
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.raw, indent=1))
        tracked = result.get("tracked_peak_bytes")
        print(f"[{self.count}] {label}: {result['tokens_per_second']:.1f} tokens/s"
              f" ({result.get('tokens_per_cpu_second') or 0:.1f} per CPU second), peak"
              f" {result['peak_bytes'] / MIB:.0f} MiB{f', tracked {tracked / MIB:.0f} MiB' if tracked else ''}"
              f" ({result['seconds']:.0f} s)", file=sys.stderr)
        return result


def p1(runner: Runner) -> tuple[str, list[list[str]]]:
    same = {"precision": "fp32", "optimizer": "adamw"}
    hf_runs, mf_runs = [], []
    for _ in range(runner.args.repeats):  # alternated, so a load that drifts does not favour one tool
        hf_runs.append(runner.run("hf", "Hugging Face Trainer", {"batch_size": runner.args.effective_batch}))
        mf_runs.append(runner.run("memfit", "memfit (defaults)", same))
    hf, mf = _median_run(hf_runs), _median_run(mf_runs)
    rows = [[r["label"], f"{r['tokens_per_second']:.1f}", f"{r['peak_bytes'] / MIB:.0f}",
             f"{r['tokens_per_second'] / hf['tokens_per_second']:.2f}", f"{r['peak_bytes'] / hf['peak_bytes']:.2f}",
             f"{r['first_loss']:.4f}"] for r in (hf, mf)]
    table = markdown_table(["run", "tokens/s", "peak RSS (MiB)", "tokens/s vs Trainer", "peak vs Trainer",
                            "loss at step 1"], rows)
    headline = (f"memfit: **{mf['tokens_per_second'] / hf['tokens_per_second']:.2f}x the Trainer's tokens/s at"
                f" {mf['peak_bytes'] / hf['peak_bytes']:.2f}x its peak RSS** (what ran: {_ran(mf)}).")
    return headline + "\n\n" + table, rows


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' median tokens/s and peak (each taken separately), labelled with their count."""
    if len(runs) == 1:
        return runs[0]
    return {**runs[0], "label": f"{runs[0]['label']} (median of {len(runs)})",
            "tokens_per_second": median([r["tokens_per_second"] for r in runs]),
            "peak_bytes": median([r["peak_bytes"] for r in runs])}


def trainer_settings(effective: int) -> list[tuple[str, dict[str, Any]]]:
    """The Trainer's own knobs, from the fastest-looking to the leanest."""
    settings = []
    micro_sizes = [m for m in (effective, effective // 2, effective // 4, 1) if m >= 1 and effective % m == 0]
    micro_sizes = list(dict.fromkeys(micro_sizes))
    for checkpointing in (False, True):
        for optim in ("adamw_torch_fused", "adamw_8bit"):
            for micro in micro_sizes:
                if optim == "adamw_8bit" and not checkpointing and micro != effective:
                    continue  # keep the grid small: 8-bit alone only at the full micro-batch
                settings.append((
                    f"bs {micro} x {effective // micro}{', checkpointing' if checkpointing else ''}"
                    f"{', adamw_8bit' if optim == 'adamw_8bit' else ''}, bf16",
                    {"batch_size": micro, "gradient_checkpointing": checkpointing, "optim": optim, "bf16": True},
                ))
    return settings


def p2(runner: Runner) -> tuple[str, list[list[str]]]:
    effective = runner.args.effective_batch
    plain = runner.run("hf", f"Trainer plain (bs {effective}, fp32)", {"batch_size": effective, "bf16": False},
                       track=True)
    budget = int(plain["tracked_peak_bytes"] * runner.args.budget_fraction)
    tried = [runner.run("hf", f"Trainer {label}", knobs, track=True) for label, knobs in trainer_settings(effective)]
    fitting = [r for r in tried if r["tracked_peak_bytes"] <= budget]
    # the fastest by CPU time: on a shared machine wall-clock rates of runs minutes apart differ by the load
    best_hf = max(fitting, key=lambda r: r["tokens_per_cpu_second"]) if fitting else None
    plan_steps = runner.args.plan_steps
    capped = runner.run("memfit", "memfit, its planner's choice, capped (every step tracked)", {"precision": "amp"},
                        budget=budget, cap=True, plan_steps=plan_steps)
    mf = runner.run("memfit", "memfit, the same plan without the cap (timed)", {"precision": "amp"}, budget=budget,
                    plan_steps=plan_steps)
    extra = []
    if best_hf is not None:
        # The Trainer's chosen setting again right after memfit: memfit is compared with the mean of the two, so a
        # load that drifts between the grid and memfit's run does not decide the ratio.
        again = runner.run("hf", f"{best_hf['label']} (again, after memfit)", best_hf["ran"])
        extra.append(again)
        if runner.args.trainer_compile:
            extra.append(runner.run("hf", f"{best_hf['label']}, torch_compile=True (informational, not tracked)",
                                    {**best_hf["ran"], "torch_compile": True}))
    # The capped run is tracked, and Dynamo compiles nothing under the tracker: a compiled plan's
    # capped run runs its blocks eager (and says so), which is the same plan for the fit check.
    eager_capped = str((capped["ran"] or {}).get("compile", "")).startswith("off (asked")
    without_compile = {k: v for k, v in (capped["ran"] or {}).items() if k != "compile"}
    same_plan = (without_compile == {k: v for k, v in (mf["ran"] or {}).items() if k != "compile"}
                 and not capped["oom_events"])
    mf = {**mf, "tracked_peak_bytes": capped["tracked_peak_bytes"], "label": "memfit, its planner's choice"}
    rows = []
    for r in [plain, *tried, mf, *extra]:
        tracked = r.get("tracked_peak_bytes")
        fits = "not tracked" if tracked is None else ("yes" if tracked <= budget else "no")
        chosen = " **(fastest that fits)**" if r is best_hf else ""
        rows.append([r["label"] + chosen + (f" ({_ran(r)})" if r["kind"] == "memfit" else ""),
                     f"{r['tokens_per_second']:.0f}", f"{r['tokens_per_cpu_second']:.0f}",
                     "-" if tracked is None else f"{tracked / MIB:.0f}", fits, f"{r['rss_peak_bytes'] / MIB:.0f}"])
    table = markdown_table(["run", "tokens/s", "tokens per CPU second", "tracked peak (MiB)",
                            f"fits {budget / MIB:.0f} MiB", "peak RSS (MiB)"], rows)
    mf_fits = mf["tracked_peak_bytes"] <= budget
    recovered = (f" The capped run recovered from {capped['oom_events']} out-of-memory event(s) (it ran"
                 f" {_ran(capped)}), so the timed run is not the plan that fitted." if not same_plan else "")
    if same_plan and eager_capped:
        recovered = (" The capped run's blocks and loss ran eager (the memory tracker that enforces the cap"
                     " stops Dynamo), so its tracked peak is the eager plan's; the compiled run's peak RSS is"
                     f" {mf['rss_peak_bytes'] / MIB:.0f} MiB against {best_hf['rss_peak_bytes'] / MIB:.0f} MiB"
                     " for the Trainer's setting." if best_hf is not None else "")
    if best_hf is None:
        headline = (f"No Trainer setting's tracked peak fits {budget / MIB:.0f} MiB; memfit runs at"
                    f" {mf['tokens_per_second']:.0f} tokens/s with a tracked peak of"
                    f" {mf['tracked_peak_bytes'] / MIB:.0f} MiB, which {'fits' if mf_fits else 'does NOT fit either'}.")
    else:
        pair = [best_hf, extra[0]]
        wall = mf["tokens_per_second"] / (sum(r["tokens_per_second"] for r in pair) / 2)
        cpu = mf["tokens_per_cpu_second"] / (sum(r["tokens_per_cpu_second"] for r in pair) / 2)
        headline = (f"Budget {budget / MIB:.0f} MiB of live tensors ({runner.args.budget_fraction:.0%} of the plain"
                    f" Trainer run's tracked peak, {plain['tracked_peak_bytes'] / MIB:.0f} MiB):"
                    f" **memfit {cpu:.2f}x the tokens per CPU second of the Trainer's fastest fitting setting"
                    f" ({wall:.2f}x its tokens/s)** ({best_hf['label']}, the mean of its two runs); memfit's"
                    f" plan (made for a {plan_steps}-step run) tracked"
                    f" {mf['tracked_peak_bytes'] / MIB:.0f} MiB, which {'fits' if mf_fits else 'does NOT fit'}"
                    f" (capped run: {capped['oom_events']} out-of-memory recoveries).")
    return headline + recovered + "\n\n" + table, rows


def gpu(runner: Runner) -> tuple[str, list[list[str]]]:
    runs = [
        runner.run("hf", "Hugging Face Trainer, bf16", {"batch_size": runner.args.effective_batch}),
        runner.run("hf", "Trainer, use_liger_kernel=True", {"batch_size": runner.args.effective_batch, "liger": True}),
        runner.run("memfit", "memfit plain", {"kernels": "none"}),
        runner.run("memfit", "memfit --compile", {"kernels": "none", "compile": True}),
        runner.run("memfit", "memfit --kernels liger", {"kernels": "liger"}),
        runner.run("memfit", "memfit --compile --kernels liger", {"kernels": "liger", "compile": True}),
    ]
    hf = runs[0]
    rows = [[r["label"], f"{r['tokens_per_second']:.0f}", f"{r['mfu']:.3f}" if r.get("mfu") else "-",
             f"{r['peak_bytes'] / MIB:.0f}", f"{r['tokens_per_second'] / hf['tokens_per_second']:.2f}",
             f"{r['peak_bytes'] / hf['peak_bytes']:.2f}"] for r in runs]
    return markdown_table(["run", "tokens/s", "MFU", "peak allocated (MiB)", "tokens/s vs Trainer",
                           "peak vs Trainer"], rows), rows


def _ran(result: dict[str, Any]) -> str:
    ran = result.get("ran") or {}
    return ", ".join(f"{k} {v}" for k, v in ran.items() if v not in (None, "", {}))


DEFAULTS = {
    "p1": {"preset": "qwen2.5-0.5b", "seq_len": 512, "effective_batch": 1, "steps": 3, "warmup": 1},
    "p2": {"preset": None, "seq_len": 512, "effective_batch": 8, "steps": 4, "warmup": 2},
    "gpu": {"preset": "llama-3.2-1b", "seq_len": 2048, "effective_batch": 4, "steps": 12, "warmup": 4},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmark", nargs="?", choices=("p1", "p2", "gpu"))
    parser.add_argument("--preset", help="model shape (a memfit preset); p2's default is the 20M Llama of bench_engine")
    parser.add_argument("--layers", type=int, help="keep only this many blocks of the preset (same width, vocabulary)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--effective-batch", type=int, help="samples per optimizer step")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--threads", type=int, help="CPU threads per run (default torch's; 1 keeps a crowded machine"
                        " from thrashing)")
    parser.add_argument("--repeats", type=int, default=1, help="p1: runs of each tool, alternated (default 1)")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="p2: budget / Trainer plain peak (0.5)")
    parser.add_argument("--plan-steps", type=int, default=1000, help="p2: memfit plans a run of this many steps (the"
                        " length --compile's one-off cost is weighed against) and trains the first --steps")
    parser.add_argument("--trainer-compile", action="store_true", help="p2: also time the Trainer's chosen setting"
                        " with torch_compile=True (informational)")
    parser.add_argument("--out", help="markdown file to write the results into (e.g. docs/benchmarks.md)")
    parser.add_argument("--json", help="also write the raw results to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        emit_result((memfit_worker if spec["kind"] == "memfit" else hf_worker)(spec))
        return 0
    if args.benchmark is None:
        parser.error("choose p1, p2 or gpu")
    for key, value in DEFAULTS[args.benchmark].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    device = "cuda" if args.benchmark == "gpu" else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_peers.py gpu: no CUDA device here", file=sys.stderr)
            return 2
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="memfit-peers-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        if args.preset:
            parameters, described = save_preset_model(model_dir, args.preset, args.layers)
        else:
            from _common import MODEL_SHAPES, save_model

            parameters = save_model(model_dir, "20m", SEED)
            shape = MODEL_SHAPES["20m"]
            described = (f"Llama shape ({shape['num_hidden_layers']} blocks of width {shape['hidden_size']},"
                         f" vocabulary {shape['vocab_size']}, tied embeddings)")
        runner = Runner(args, device, workdir, model_dir)
        body, _ = {"p1": p1, "p2": p2, "gpu": gpu}[args.benchmark](runner)
    load_end = os.getloadavg()
    command = "python benchmarks/bench_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"Model: {parameters / 1e6:.0f}M parameters, {described}, random init with a fixed seed, saved once and"
        f" loaded by every run. Data: the bundled corpus, windows of {args.seq_len} tokens, {args.effective_batch}"
        f" samples per optimizer step, {args.steps} steps of which {args.warmup} warm-up; each run a fresh process"
        f"{f' with {args.threads} CPU thread(s)' if args.threads else ''}.",
        "",
        body,
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Machine: {machine_description(device)}; load average (1 min) {load_start[0]:.1f} at the start,"
        f" {load_end[0]:.1f} at the end",
        "",
        f"Date: {today()}",
    ])
    print(text)
    if args.out:
        from _common import write_section

        titles = {"p1": "P1, same config, bigger model", "p2": "P2, same memory budget", "gpu": "GPU"}
        write_section(args.out, SECTION, text, subheading=f"{titles[args.benchmark]} ({default_label(device)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

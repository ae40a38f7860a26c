"""Online RL (GRPO): memfit's `--task grpo` against TRL's GRPOTrainer, steps/s and peak memory on a CPU.

    python benchmarks/bench_grpo.py                                # ~23M Llama, 8 completions of 64 tokens a step
    python benchmarks/bench_grpo.py --out docs/benchmarks.md       # also write the tables into the docs (own section)
    python benchmarks/bench_grpo.py --longest 2GiB                 # also: the longest completion one step fits
    python benchmarks/bench_grpo.py --quick                        # toy model, a smoke run in seconds
    python benchmarks/bench_grpo.py --learning --out docs/benchmarks.md  # mean reward per step, both tools learning

Needs TRL (`pip install 'memfit[bench]'`). CPU only, fp32 on both sides, generation by transformers on both sides
(TRL's `model.generate`, memfit's own sampling loop over the model's forward with a key-value cache; no vLLM).

One Llama-shaped model (benchmarks/_common.py's "20m": 6 blocks of width 384, a 32000-token vocabulary, tied
embeddings) is built with a fixed seed and saved once with the byte tokenizer. The prompts: a JSONL this script
writes, plain-text prompts of exactly --prompt-length tokens each (one byte a token), one per prompt the run needs,
so memory and time depend on the lengths and not on which prompts a step draws. The reward: one function in a file
this script writes, given to memfit as `--reward-function FILE.py:low_token_share` and to TRL as the same function
object: the share of a completion's token ids below half the vocabulary (a random model's completions differ in it, so
the advantages are not all zero and the update is a real one). Both tools get the same num_generations,
max_completion_length, temperature 1, batch size counted in completions (one micro-batch a step, one generation
batch a step), beta 0, loss type, lr (constant, no warm-up), AdamW (torch's fused kernel, betas (0.9, 0.999), no
weight decay, clipping at 1.0), steps, seed, fp32, SDPA attention. The random model hardly ever samples its EOS
(1 id in 32000), so nearly every completion runs to max_completion_length on both sides: each row shows its mean
completion length, so that equal work is visible rather than assumed.

Runs and what each side does:

- TRL's defaults: `gradient_checkpointing=True` (GRPOConfig's default; off while generating), the policy's
  log-probabilities from its fused LM head (`fused_lm_head=True`: in tiles, no full logits). `bf16=False` set (its
  default is bf16 autocast), to compare fp32 with fp32.
- memfit's defaults (`memfit train --task grpo`): no checkpointing, the log-probabilities in chunks whose logits are
  about the size of the batch's hidden states (at the default sizes, 8 completions of 96 tokens: 64-token chunks),
  over the completions' positions only.
- The same settings on both sides: memfit `--gradient-checkpointing full` beside TRL's defaults; TRL
  `gradient_checkpointing=False` beside memfit's defaults.

Each run is a fresh Python process with one torch thread (--threads; OMP_NUM_THREADS and MKL_NUM_THREADS), both
tools alike: on the shared 2-core machine two threads made every small decoding forward about 30x slower for both, a
figure of the machine's contention rather than of either tool. With --repeats 2 the two default runs alternate (TRL,
memfit, the others, TRL, memfit) and their figures are medians; by default each runs once. (`--quick` runs everything
in this script's process, one run after another: a smoke run, whose peaks are the highest so far.)

steps/s: the median over the steps after warm-up of 1 / (time from the end of the previous step to the end of this
one): a step holds its rollout (generation and rewards) and its training pass. steps per CPU second the same with the
process's CPU time (all threads), which a busy machine disturbs less. Start-up (process start to the first step) is
left out and shown apart. Peak: the process's peak resident memory (VmHWM) from its start to the end of its last
step, Python and libraries included; memfit resets VmHWM at each step, so its peak is read before every reset
(benchmarks/_common.py's PeakWatch, as bench_preference.py). Ratios are memfit / TRL, within one run of this script.

`--longest CAP` (optional, coarse; as bench_preference.py's): for TRL's defaults, memfit's defaults and memfit
`--gradient-checkpointing full`, one step at each max_completion_length of a doubling ladder (--longest-lengths), each
in a fresh process, until the peak passes CAP; a length fits when the step completes with its peak RSS within CAP.
The longest fitting length is reported, and an estimate between it and the next ladder length by linear
interpolation of the measured peaks. No limit is enforced on either side (memfit's `--memory-cap` caps tracked
tensor bytes, which TRL has no counterpart of): both are measured alike.

`--learning` (instead of the speed runs): does memfit learn as fast as TRL? A toy Llama (benchmarks/_common.py's
"quick" shape: 2 blocks of width 64, the byte tokenizer), the same prompts, and a reward a tiny model can raise within
a few dozen steps: each completion's mean of token id modulo 10, over 10 (`token_value`, as the learning test in
tests/integration/test_grpo_learning.py). Both tools get the same LEARNING settings (AdamW, lr, num_generations,
completions a step, steps, seed, clipping, beta 0). Each records the mean reward of every step (TRL's logged
`reward`, memfit's metrics.jsonl `reward`); the rise is the mean over the last --learning-window steps minus the mean
over the first ones, of the reward per step averaged over seeds 0 to --repeats - 1 (3 by default; each seed's rise
is shown too, the noise at this size being large), and the ratio memfit's rise / TRL's. Each run a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_runs  # noqa: E402
from _common import (  # noqa: E402
    MODEL_SHAPES,
    default_label,
    emit_result,
    instrumented_loop,
    markdown_table,
    median,
    run_worker,
    save_model,
    write_section,
)
from peer_runs import CPU_ONLY, Clock, longest_of, provenance, ratio, save_json, what_ran  # noqa: E402

SECTION = "Online RL (GRPO): memfit and TRL's GRPOTrainer"
MIB = 1024**2

LR, BETAS, EPS, MAX_GRAD_NORM, SEED, TEMPERATURE = 1e-5, (0.9, 0.999), 1e-8, 1.0, 0, 1.0
STEPS_DEFAULT = 4

# (name, label, tool, settings). memfit settings are config overrides; TRL settings are GRPOConfig fields.
CONFIGURATIONS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("trl", "TRL GRPOTrainer, its defaults (checkpointing on)", "trl", {}),
    ("memfit", "memfit `--task grpo`, its defaults (no checkpointing)", "memfit", {}),
    ("trl-no-ckpt", "TRL `gradient_checkpointing=False`", "trl", {"gradient_checkpointing": False}),
    ("memfit-ckpt", "memfit `--gradient-checkpointing full`", "memfit", {"gradient_checkpointing": "full"}),
]
REPEATED = ("trl", "memfit")

COMPARISONS = [
    ("(1) each at its defaults: memfit's defaults / TRL's defaults", "memfit", "trl"),
    ("(2) same settings, checkpointing on: memfit `--gradient-checkpointing full` / TRL's defaults",
     "memfit-ckpt", "trl"),
    ("(2) same settings, no checkpointing: memfit's defaults / TRL `gradient_checkpointing=False`",
     "memfit", "trl-no-ckpt"),
]

LONGEST_SIDES = [("trl", "TRL's defaults"), ("memfit", "memfit's defaults"),
                 ("memfit-ckpt", "memfit `--gradient-checkpointing full`")]

# One torch thread a run, both tools: on a 2-core machine shared with other jobs, two threads made a 4-row decoding
# forward of the 20m model about 30x slower (1.35 s against 0.05 s, 2026-11-28), for both tools alike, which would
# measure the machine's contention rather than the tools. --threads changes it.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

REWARD_SOURCE = '''"""The benchmark's reward: the share of a completion's token ids below half the vocabulary."""

VOCABULARY = {vocabulary}


def low_token_share(completion_ids, **kwargs):
    return [sum(1 for token in ids if token < VOCABULARY // 2) / max(1, len(ids)) for ids in completion_ids]
'''
REWARD_NAME = "low_token_share"
LEARNING_REWARD_NAME = "token_value"
LEARNING_REWARD_SOURCE = '''

def token_value(completion_ids, **kwargs):
    return [sum(token % 10 for token in ids) / (10 * max(1, len(ids))) for ids in completion_ids]
'''
LEARNING = {"lr": 3e-3, "num_generations": 4, "batch_size": 16, "completion_length": 8, "prompt_length": 16,
            "steps": 30, "window": 5, "seeds": 3}
"""--learning's settings, both tools: AdamW at a constant lr, clipping at MAX_GRAD_NORM, beta 0, loss type dapo."""
LEARNING_SECTION = "CPU, 2 cores, learning: mean reward per step"

WORDS = ("memory gradient batch token model layer training fits device loss step context offload answer "
         "reward policy group advantage completion prompt the a of to and is in it").split()


# ---------------------------------------------------------------------------
# Data and reward
# ---------------------------------------------------------------------------


def write_prompts(path: Path, length: int, count: int) -> list[dict]:
    """`count` plain-text prompts of exactly `length` characters (one byte token each), as JSONL."""
    rng = random.Random(SEED)
    records = []
    for _ in range(count):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < length:
            words.append(rng.choice(WORDS))
        records.append({"prompt": " ".join(words)[:length].rstrip().ljust(length, "."), "answer": "0"})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def write_reward(path: Path, vocabulary: int) -> Path:
    path.write_text(REWARD_SOURCE.format(vocabulary=vocabulary) + LEARNING_REWARD_SOURCE)
    return path


def load_reward(path: str, name: str = REWARD_NAME) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grpo_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# ---------------------------------------------------------------------------
# Workers: one run, in a fresh process
# ---------------------------------------------------------------------------


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    import memfit.train.loop as loop
    from memfit.config_loading import load_config

    clock = Clock()
    lengths: list[float] = []
    rewards: list[float] = []

    def on_record(record: dict[str, Any]) -> None:  # each step's end is stamped when its metrics line is written
        if record.get("event") == "start" or ("event" not in record and "step" in record):
            clock.tick()
        if "event" not in record and "completions/mean_length" in record:
            lengths.append(float(record["completions/mean_length"]))
            rewards.append(float(record["reward"]))

    overrides = {
        "model": spec["model_dir"], "dataset": spec["data"], "task": "grpo",
        "reward_function": f"{spec['reward_file']}:{spec.get('reward', REWARD_NAME)}",
        "num_generations": spec["num_generations"],
        "max_completion_length": spec["completion_length"], "temperature": TEMPERATURE,
        "seq_len": spec["prompt_length"] + spec["completion_length"], "batch_size": spec["batch_size"],
        "gradient_accumulation_steps": 1, "max_steps": spec["steps"], "seed": spec.get("seed", SEED),
        "lr": spec.get("lr", LR),
        "lr_schedule": "constant", "warmup_steps": 0, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
        "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM, "optimizer": "adamw", "precision": "fp32",
        "beta": 0.0, "loss_type": spec["loss_type"], "output_dir": spec["output_dir"], "cache_dir": spec["cache_dir"],
        "log_every": 1, "report": False, **spec["settings"],
    }
    with instrumented_loop(loop, clock.watch, on_record):
        result = loop.train(load_config(overrides={k: str(v) for k, v in overrides.items()}))
    out = clock.figures("steps", 1, spec["warmup"], started) | {"mean_lengths": lengths, "rewards": rewards}
    out["ran"] = {key: result.summary.get(key) for key in ("precision", "optimizer", "attention",
                                                           "gradient_checkpointing")}
    return out


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock = Clock()
    lengths: list[float] = []
    rewards: list[float] = []
    records = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]

    class Stamps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.tick()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))
                rewards.append(float(logs["reward"]))

    torch.manual_seed(spec.get("seed", SEED))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    arguments = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, num_generations=spec["num_generations"],
        max_completion_length=spec["completion_length"], temperature=TEMPERATURE,
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1, max_steps=spec["steps"],
        learning_rate=spec.get("lr", LR), lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused",
        beta=0.0, loss_type=spec["loss_type"], logging_strategy="steps", logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=spec.get("seed", SEED),
        shuffle_dataset=False, **spec["settings"],
    )
    reward = load_reward(spec["reward_file"], spec.get("reward", REWARD_NAME))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=arguments,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[Stamps()])
    trainer.train()
    out = clock.figures("steps", 1, spec["warmup"], started) | {"mean_lengths": lengths, "rewards": rewards}
    out["ran"] = {"precision": "fp32", "optimizer": getattr(arguments.optim, "value", arguments.optim),
                  "attention": "sdpa", "gradient_checkpointing": arguments.gradient_checkpointing}
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    return (memfit_worker if spec["tool"] == "memfit" else trl_worker)(spec)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-length", type=int, default=32, help="tokens of every prompt (default 32)")
    parser.add_argument("--completion-length", type=int, default=64,
                        help="max_completion_length, both tools (default 64)")
    parser.add_argument("--num-generations", type=int, default=4, help="completions a prompt (default 4)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="completions a step, one micro-batch (default 8: 2 prompts x 4)")
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT,
                        help=f"optimizer steps per run (default {STEPS_DEFAULT}; --learning: {LEARNING['steps']})")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of steps/s (default 1)")
    parser.add_argument("--loss-type", default="dapo", choices=("dapo", "grpo", "dr_grpo", "bnpo"),
                        help="loss type, both tools (default dapo, both tools' default)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of TRL's defaults and of memfit's defaults, alternated, their figures medians"
                             " (default 1: each run takes about a minute on the 2-core dev machine); --learning:"
                             f" the seeds (default {LEARNING['seeds']})")
    parser.add_argument("--only", help="comma-separated runs (default all): " + ", ".join(c[0] for c in CONFIGURATIONS)
                        + "; 'none' with --longest for the ladder alone")
    parser.add_argument("--longest", metavar="CAP", help="also find the longest completion one step fits in CAP")
    parser.add_argument("--longest-lengths", default="64,128,256,512",
                        help="the ladder of max_completion_length for --longest (default 64,128,256,512)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each run, both tools (default 1: see THREAD_VARIABLES)")
    parser.add_argument("--quick", action="store_true",
                        help="toy model, completions of 16 tokens, 4 a step, 2 steps, every run in this process")
    parser.add_argument("--learning", action="store_true",
                        help="instead of the speed runs: mean reward per step of both tools learning a toy reward")
    parser.add_argument("--out", help="markdown file to write the results section into (e.g. docs/benchmarks.md)")
    parser.add_argument("--label", help="title of this run's subsection in --out (default 'CPU, N cores')")
    parser.add_argument("--json", help="also write the raw results of every run to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.learning:  # its own steps (--steps, when given), window and seeds (--repeats, when given)
        args.steps = args.steps if args.steps != STEPS_DEFAULT else LEARNING["steps"]
        args.repeats = args.repeats if args.repeats != 1 else LEARNING["seeds"]
        args.warmup = 1
        args.learning_window = min(LEARNING["window"], max(1, args.steps // 2))
        if args.quick:
            args.steps, args.learning_window, args.repeats = 4, 2, 1
    elif args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
        args.prompt_length, args.completion_length, args.num_generations, args.batch_size = 16, 16, 2, 4
        if args.longest:
            args.longest_lengths = "8,16"
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.batch_size % args.num_generations:
        parser.error(f"--batch-size ({args.batch_size}) counts completions: a multiple of --num-generations"
                     f" ({args.num_generations})")
    if args.longest:
        from memfit.units import parse_size

        args.cap_bytes = parse_size(args.longest, "--longest")
        args.ladder = sorted(int(x) for x in args.longest_lengths.split(","))
    return args


def base_spec(args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, Any]:
    return {"model_dir": str(paths["model"]), "data": str(paths["data"]), "reward_file": str(paths["reward"]),
            "prompt_length": args.prompt_length, "completion_length": args.completion_length,
            "num_generations": args.num_generations, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "loss_type": args.loss_type}


def run_one(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    # --quick: every run in this process, one after another (torch and TRL imported once): a smoke run.
    return worker(spec) if args.quick else run_worker(__file__, spec, timeout=1800, env=worker_environment(args))


def worker_environment(args: argparse.Namespace) -> dict[str, str]:
    return {**CPU_ONLY, **{name: str(args.threads) for name in THREAD_VARIABLES}}


def run_plan(args: argparse.Namespace, workdir: Path, paths: dict[str, Path]) -> dict[str, list[dict]]:
    wanted = set(args.only.split(",")) if args.only else {c[0] for c in CONFIGURATIONS}
    configurations = [c for c in CONFIGURATIONS if c[0] in wanted]
    pair = [c for c in configurations if c[0] in REPEATED]
    others = [c for c in configurations if c[0] not in REPEATED]
    plan = list(pair) + others + [c for _ in range(args.repeats - 1) for c in pair]  # TRL, memfit, ..., TRL, memfit
    results: dict[str, list[dict]] = {c[0]: [] for c in configurations}
    for number, (name, label, tool, settings) in enumerate(plan, 1):
        spec = {**base_spec(args, paths), "name": name, "tool": tool, "settings": settings,
                "output_dir": str(workdir / f"run-{number}-{name}"), "cache_dir": str(workdir / f"cache-{number}")}
        began = time.perf_counter()
        result = run_one(args, spec)
        result["load_average"] = os.getloadavg()[0]  # as the run ends: timings are read beside it
        results[name].append(result)
        save_json(args, {"runs": results})
        print(f"[{number}/{len(plan)}] {label}: {result['steps_per_second']:.3f} steps/s,"
              f" {result['steps_per_cpu_second']:.3f} steps/CPU s, peak {result['peak_bytes'] / MIB:.0f} MiB"
              f" ({time.perf_counter() - began:.0f} s, load average {result['load_average']:.1f})", file=sys.stderr)
    return results


def run_longest(args: argparse.Namespace, workdir: Path, paths: dict[str, Path]) -> dict[str, list[dict]]:
    """One step at each ladder length of max_completion_length, each side until its peak passes the cap."""
    ladder: dict[str, list[dict]] = {}
    settings = {name: (tool, values) for name, _, tool, values in CONFIGURATIONS}
    for name, label in LONGEST_SIDES:
        ladder[name] = []
        for length in args.ladder:
            tool, values = settings[name]
            tag = f"longest-{name}-{length}"
            spec = {**base_spec(args, paths), "name": tag, "tool": tool, "settings": values,
                    "completion_length": length, "steps": 1, "warmup": 0, "output_dir": str(workdir / tag),
                    "cache_dir": str(workdir / tag / "c")}
            began = time.perf_counter()
            try:
                result = run_one(args, spec)
                entry = {"length": length, "completed": True, "peak_bytes": result["peak_bytes"],
                         "mean_length": (result["mean_lengths"] or [None])[0]}
            except (RuntimeError, MemoryError, subprocess.TimeoutExpired) as error:  # killed for memory, failed: over
                entry = {"length": length, "completed": False, "peak_bytes": None, "error": str(error)[-400:]}
            entry["fits"] = bool(entry["completed"] and entry["peak_bytes"] <= args.cap_bytes)
            ladder[name].append(entry)
            save_json(args, {"longest": ladder})
            peak = f"peak {entry['peak_bytes'] / MIB:.0f} MiB" if entry["peak_bytes"] else "failed"
            print(f"[longest] {label}, completions of {length} tokens: {peak},"
                  f" {'fits' if entry['fits'] else 'over'} {args.longest} ({time.perf_counter() - began:.0f} s)",
                  file=sys.stderr)
            if not entry["fits"]:
                break
    return ladder


def run_learning(args: argparse.Namespace, workdir: Path, paths: dict[str, Path]) -> dict[str, list[dict]]:
    """memfit and TRL, one fresh process a run, the same LEARNING settings and token_value reward, seeds 0 to
    --repeats - 1 (TRL then memfit at each seed): their runs, with each step's mean reward."""
    results: dict[str, list[dict]] = {"trl": [], "memfit": []}
    for seed in range(args.repeats):
        for tool in ("trl", "memfit"):
            name = f"learning-{tool}-{seed}"
            spec = {**base_spec(args, paths), **{k: v for k, v in LEARNING.items() if k not in ("window", "seeds")},
                    "steps": args.steps, "warmup": 1, "loss_type": "dapo", "reward": LEARNING_REWARD_NAME,
                    "seed": seed, "name": name, "tool": tool, "settings": {}, "output_dir": str(workdir / name),
                    "cache_dir": str(workdir / f"{name}-cache")}
            began = time.perf_counter()
            result = run_one(args, spec)
            result["load_average"] = os.getloadavg()[0]
            result["seconds"] = time.perf_counter() - began
            results[tool].append(result)
            save_json(args, {"learning": results})
            print(f"[learning] {tool}, seed {seed}: rewards {' '.join(f'{r:.2f}' for r in result['rewards'])}"
                  f" ({result['seconds']:.0f} s, load average {result['load_average']:.1f})", file=sys.stderr)
    return results


def mean_per_step(runs: list[dict]) -> list[float]:
    """Each step's mean reward, averaged over the runs (seeds)."""
    steps = min(len(run["rewards"]) for run in runs)
    return [sum(run["rewards"][step] for run in runs) / len(runs) for step in range(steps)]


def rise(rewards: list[float], window: int) -> float | None:
    """Mean reward over the last `window` steps minus the mean over the first `window` (None when too few steps)."""
    if len(rewards) < 2 * window:
        return None
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


def learning_report(args: argparse.Namespace, results: dict[str, list[dict]], parameters: int, command: str,
                    load_start: tuple[float, ...]) -> str:
    window, shape, seeds = args.learning_window, MODEL_SHAPES["quick"], args.repeats
    curves = {tool: mean_per_step(runs) for tool, runs in results.items()}
    rises = {tool: rise(curve, window) for tool, curve in curves.items()}
    rows = [[str(step + 1)] + [f"{curves[tool][step]:.3f}" for tool in ("trl", "memfit")]
            for step in range(min(len(curve) for curve in curves.values()))]
    summary = []
    for tool, label in (("trl", "TRL GRPOTrainer"), ("memfit", "memfit `--task grpo`")):
        curve, runs = curves[tool], results[tool]
        per_seed = ", ".join(f"{value:+.3f}" if value is not None else "-"
                             for value in (rise(run["rewards"], window) for run in runs))
        summary.append([label, f"{sum(curve[:window]) / window:.3f}", f"{sum(curve[-window:]) / window:.3f}",
                        f"{rises[tool]:+.3f}" if rises[tool] is not None else "-", per_seed,
                        f"{sum(run['seconds'] for run in runs) / len(runs):.0f}",
                        f"{max(run['load_average'] for run in runs):.1f}"])
    mine, theirs = rises.get("memfit"), rises.get("trl")
    verdict = (f"memfit's rise / TRL's rise: {mine / theirs:.2f}" if mine is not None and theirs and theirs > 0 else
               f"no ratio: TRL's rise is {theirs if theirs is None else f'{theirs:+.3f}'} (not above 0)")
    lines = [
        f"Model: Llama-shaped, {parameters / 1e6:.2f}M parameters ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, vocabulary {shape['vocab_size']}), random init with a fixed seed, the byte"
        f" tokenizer. Prompts: plain text of {LEARNING['prompt_length']} tokens, written by the script. Reward"
        " `token_value`: a completion's mean of token id modulo 10, over 10 (0.45 expected of uniform tokens; the"
        f" model can raise it by preferring some ids). Both tools: AdamW (lr {LEARNING['lr']:g} constant, betas"
        f" {BETAS}, no weight decay), clipping at {MAX_GRAD_NORM:g}, num_generations {LEARNING['num_generations']},"
        f" {LEARNING['batch_size']} completions a step (one micro-batch), max_completion_length"
        f" {LEARNING['completion_length']}, temperature {TEMPERATURE:g}, beta 0, loss type dapo, {args.steps} steps,"
        f" seeds 0 to {seeds - 1} (a run of each tool at each seed), fp32, generation by transformers,"
        f" {args.threads} torch thread a run, each run a fresh process.",
        "",
        f"Rise: mean reward over the last {window} steps minus over the first {window}, of the reward per step"
        f" averaged over the {seeds} seed{'s' if seeds > 1 else ''}. {verdict}. At this size one seed's rise is"
        " noisy: each seed's rise is shown.",
        "",
        markdown_table(["tool", f"first {window} steps", f"last {window} steps", "rise", "rise per seed",
                        "run (s, mean)", "load"], summary),
        "",
        "Mean reward per step over the seeds (TRL's logged `reward`; memfit's `reward` in metrics.jsonl):",
        "",
        markdown_table(["step", "TRL", "memfit"], rows),
        *provenance(command, load_start),
    ]
    return "\n".join(lines)


def learning_main(args: argparse.Namespace, command: str) -> int:
    """--learning: both tools learning the toy reward side by side (module docstring), reported apart."""
    load_start, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memfit-bench-grpo-learning-") as scratch:
        workdir = Path(scratch)
        paths = {"model": workdir / "model", "data": workdir / "prompts.jsonl", "reward": workdir / "reward.py"}
        parameters = save_model(paths["model"], "quick", seed=SEED)
        write_prompts(paths["data"], LEARNING["prompt_length"],
                      args.steps * LEARNING["batch_size"] // LEARNING["num_generations"])
        write_reward(paths["reward"], MODEL_SHAPES["quick"]["vocab_size"])
        results = run_learning(args, workdir, paths)
    body = learning_report(args, results, parameters, command, load_start)
    print(body)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        write_section(args.out, SECTION, body, args.label or LEARNING_SECTION)
    return 0


def summarize(results: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    return peer_runs.summarize(results, ("steps_per_second", "steps_per_cpu_second"), mean_length=lambda runs: median(
        [x for r in runs for x in r["mean_lengths"]]))


def longest_report(args: argparse.Namespace, ladder: dict[str, list[dict]]) -> list[str]:
    rows, found = [], {}
    for name, label in LONGEST_SIDES:
        entries = ladder.get(name, [])
        best, estimate, text = longest_of(entries, args.cap_bytes)
        found[name] = (best, estimate)
        peaks = ", ".join(f"{e['length']}: {e['peak_bytes'] / MIB:.0f}" if e["completed"] else f"{e['length']}: failed"
                          for e in entries)
        rows.append([label, str(best) if best else "-", text, peaks])
    lines = [
        f"**Longest completion within {args.longest}**",
        "",
        f"One step ({args.batch_size} completions of {args.num_generations} a prompt, prompts of"
        f" {args.prompt_length} tokens) at each max_completion_length of the ladder, a fresh process each, a side"
        " stopping at its first length over the cap. A length fits when the step completes with the process's peak"
        f" RSS (VmHWM, from its start) within {args.longest}; the estimate interpolates the measured peaks linearly"
        " between the longest fitting length and the next. Nothing enforces the cap on either side: both are measured"
        " alike.",
        "",
        markdown_table(["run", "longest fitting length", "estimate", "peak RSS (MiB) at each length"], rows),
    ]
    for name, label in LONGEST_SIDES[1:]:
        (mine, mine_estimate), (theirs, theirs_estimate) = found.get(name, (None, None)), found.get("trl", (None, None))
        if mine_estimate and theirs_estimate:
            lines += ["", f"{label} / TRL's defaults, longest completion: {mine_estimate / theirs_estimate:.2f}"
                          f" (estimates), {mine / theirs:.2f} (ladder lengths)"]
        elif mine and theirs:
            lines += ["", f"{label} / TRL's defaults, longest completion: at least {mine / theirs:.2f} (ladder"
                          " lengths; a side has no length over the cap to interpolate to)"]
        else:
            lines += ["", f"{label} / TRL's defaults: no ratio, a side has no length within the cap (give"
                          " --longest-lengths that start lower)"]
    return lines


def report(args: argparse.Namespace, summary: dict[str, dict[str, Any]], ladder: dict[str, list[dict]] | None,
           parameters: int, command: str, load_start: tuple[float, ...]) -> str:
    shape = MODEL_SHAPES["quick" if args.quick else "20m"]
    rows = []
    for name, label, _, _ in CONFIGURATIONS:
        if name not in summary:
            continue
        f = summary[name]
        runs = f" (median of {f['runs']})" if f["runs"] > 1 else ""
        rows.append([label + runs, f"{f['steps_per_second']:.3f}", f"{f['steps_per_cpu_second']:.3f}",
                     f"{f['peak_bytes'] / MIB:.0f}", f"{f['startup_seconds']:.0f}",
                     f"{f['mean_length']:.1f}" if f["mean_length"] is not None else "-", f"{f['load_average']:.1f}"])
    comparisons = []
    for what, mine, theirs in COMPARISONS:
        if mine in summary and theirs in summary:
            m, t = summary[mine], summary[theirs]
            comparisons.append([what, ratio(m["peak_bytes"], t["peak_bytes"]),
                                ratio(m["steps_per_second"], t["steps_per_second"]),
                                ratio(m["steps_per_cpu_second"], t["steps_per_cpu_second"])])
    import_rss = {tool: summary[name]["import_rss_bytes"] / MIB for tool, name in (("TRL", "trl"), ("memfit", "memfit"))
                  if name in summary}
    lines = [
        f"Model: Llama-shaped, {parameters / 1e6:.1f}M parameters ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, {shape['num_attention_heads']} heads, MLP {shape['intermediate_size']}, vocabulary"
        f" {shape['vocab_size']}, tied embeddings), random init with a fixed seed, saved once with the byte tokenizer."
        f" Prompts: plain text of {args.prompt_length} tokens each, written by the script. Both tools:"
        f" num_generations {args.num_generations}, max_completion_length {args.completion_length}, temperature"
        f" {TEMPERATURE:g}, {args.batch_size} completions a step (one micro-batch, one generation batch), beta 0, loss"
        f" type {args.loss_type}, {args.steps} steps (warm-up, left out of steps/s: {args.warmup}), the same reward"
        f" function (the share of a completion's token ids below half the vocabulary), fp32, SDPA attention, fused"
        f" AdamW (lr {LR:g} constant, betas {BETAS}, no weight decay), clipping at {MAX_GRAD_NORM:g}, generation by"
        f" transformers (no vLLM), {args.threads} torch thread{'s' if args.threads > 1 else ''} a run (on this shared"
        " 2-core machine two threads made each small decoding forward about 30x slower for both tools: that would"
        " measure the machine's contention, not the tools).",
        "",
        "TRL's defaults: `gradient_checkpointing=True` (off while generating), the log-probabilities from its fused"
        " LM head (in tiles, no full logits); `bf16=False` set (its default is bf16). memfit's defaults: no"
        " checkpointing, the log-probabilities in chunks whose logits are about the size of the batch's hidden"
        " states (64 tokens here), over the completions' positions only, with the head's gradients taken in forward"
        " from the loss's gradient said ahead (no second pass over the chunks); each distinct prompt's first"
        " forward once, its last position's logits only; glibc's mmap threshold fixed at 4 MiB"
        " (`--host-mmap-threshold`: large freed host blocks leave the process)."
        + ((" Each row a fresh process; the two default runs alternate and their figures are medians."
            if args.repeats > 1 else " Each row one run, a fresh process.")
           if not args.quick else " --quick: every row in this script's process, one after another, so a row's peak"
           " is the highest so far."),
        "",
        "steps/s: median over the steps after warm-up of 1 / (time from the end of the previous step to the end of"
        " this one), rollout (generation, rewards) and training pass included; steps/CPU s the same over the"
        " process's CPU time. start-up: process start to the first step. Peak RSS: the process's VmHWM from its start"
        " to the end of its last step, including what Python and the libraries hold before the model is loaded ("
        + ", ".join(f"{tool} about {v:.0f} MiB" for tool, v in import_rss.items())
        + "). mean length: completion tokens, the median over the steps of each step's mean (the random model"
        " hardly ever samples its EOS, so both sides generate about max_completion_length a completion). load: the"
        f" 1-minute load average as the row's runs ended (the largest over its runs; {os.cpu_count()} logical CPUs"
        " here).",
        "",
        markdown_table(["run", "steps/s", "steps/CPU s", "peak RSS (MiB)", "start-up (s)", "mean length", "load"],
                       rows),
        "",
        what_ran(summary, CONFIGURATIONS),
        "",
        "Ratios, memfit / TRL (peak below 1: memfit holds less; steps/s above 1: memfit is faster):",
        "",
        markdown_table(["comparison", "peak RSS", "steps/s", "steps/CPU s"], comparisons),
    ]
    if ladder is not None:
        lines += ["", *longest_report(args, ladder)]
    lines += provenance(command, load_start)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    import importlib.util

    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"bench_grpo needs {' and '.join(missing)}: pip install 'memfit[bench]'")
    if args.quick:  # the runs in this process: on the CPU, as the workers
        import torch

        os.environ.update(CPU_ONLY)
        torch.set_num_threads(args.threads)
    if args.learning:
        return learning_main(args, ("python benchmarks/bench_grpo.py " + " ".join(
            sys.argv[1:] if argv is None else argv)).strip())
    load_start = os.getloadavg()
    started = time.perf_counter()
    shape = "quick" if args.quick else "20m"
    with tempfile.TemporaryDirectory(prefix="memfit-bench-grpo-") as scratch:
        workdir = Path(scratch)
        paths = {"model": workdir / "model", "data": workdir / "prompts.jsonl", "reward": workdir / "reward.py"}
        parameters = save_model(paths["model"], shape, seed=SEED)
        write_prompts(paths["data"], args.prompt_length, args.steps * args.batch_size // args.num_generations)
        write_reward(paths["reward"], MODEL_SHAPES[shape]["vocab_size"])
        results = {} if args.only == "none" else run_plan(args, workdir, paths)
        ladder = run_longest(args, workdir, paths) if args.longest else None
    summary = summarize(results)
    command = "python benchmarks/bench_grpo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    body = report(args, summary, ladder, parameters, command.strip(), load_start)
    print(body)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        write_section(args.out, SECTION, body, args.label or default_label("cpu"))
    save_json(args, {"summary": summary})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

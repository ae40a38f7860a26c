"""Engine benchmark: peak memory and tokens/s of memfit's memory switches, next to Hugging Face Trainer.

    python benchmarks/bench_engine.py                             # ~23M Llama, seq 512, batch 4 (~6 min on 2 idle CPU cores)
    python benchmarks/bench_engine.py --out docs/benchmarks.md    # also write the table into the docs (its own subsection)
    python benchmarks/bench_engine.py --quick                     # toy model, a smoke run in seconds
    python benchmarks/bench_engine.py --device cuda               # GPU: bf16, peaks from the CUDA allocator

One Llama-shaped model is built with a fixed seed and saved once; every configuration
then loads it and trains on the same windows of the bundled corpus, each in a fresh
Python process (peaks never mix). Hugging Face `transformers.Trainer` runs the same
model on the same samples in the same order, with the same optimizer settings, as the
reference. Runs alternate (HF, memfit, ..., HF, memfit) and the pair's figures are
medians, because a shared machine is noisy.

tokens/s: the median over the steps after warm-up of (tokens of the step) / (time from
the end of the previous step to the end of this one), for both trainers alike; start-up
and the end-of-run save are outside it. Peak: CPU: the process's peak resident memory
(VmHWM) from its start to the end of its last step, Python and libraries included;
CUDA: `torch.cuda.max_memory_allocated` over the same span.
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
    MODEL_SHAPES,
    PeakWatch,
    current_rss_bytes,
    default_label,
    emit_result,
    instrumented_loop,
    machine_description,
    markdown_table,
    median,
    resolve_device,
    run_worker,
    save_model,
    synchronize,
    today,
    write_section,
)

SECTION = "Engine: memory switches and Hugging Face Trainer"
MIB = 1024**2

# (name, label, kind, memfit overrides). The memfit baseline matches the Trainer: fp32
# (bf16 on CUDA), fused AdamW, no checkpointing, the loss over the full logits.
CONFIGURATIONS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("hf", "Hugging Face Trainer (reference)", "hf", {}),
    ("baseline", "memfit baseline (same settings)", "memfit", {}),
    ("loss-chunks", "memfit + `--loss-chunk-size 1024`", "memfit", {"loss_chunk_size": 1024}),
    ("checkpointing", "memfit + `--gradient-checkpointing full`", "memfit", {"gradient_checkpointing": "full"}),
    ("precision", "memfit + `--precision bf16`", "memfit", {"precision": "bf16"}),
    ("8bit", "memfit + `--optimizer adamw-8bit`", "memfit", {"optimizer": "adamw-8bit"}),
    (
        "all",
        "memfit + all four",
        "memfit",
        {"loss_chunk_size": 1024, "gradient_checkpointing": "full", "precision": "bf16", "optimizer": "adamw-8bit"},
    ),
]
REPEATED = ("hf", "baseline")


def configurations_for(device: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """CONFIGURATIONS for `device`: on CUDA both trainers run bf16, so the precision row shows fp32."""
    if device != "cuda":
        return CONFIGURATIONS
    fp32 = ("precision", "memfit + `--precision fp32`", "memfit", {"precision": "fp32"})
    return [
        fp32 if c[0] == "precision" else c for c in CONFIGURATIONS
    ]  # run `--repeats` times, alternately; the rest once


# Optimizer settings both trainers use (memfit's defaults; HF's cosine decays to 0, memfit's to 10%).
LR, BETAS, EPS, MAX_GRAD_NORM, SEED = 1e-3, (0.9, 0.95), 1e-8, 1.0, 0


# ---------------------------------------------------------------------------
# Workers: one configuration, in a fresh process
# ---------------------------------------------------------------------------


def _step_rates(stamps: list[float], tokens: list[int], warmup: int) -> list[float]:
    """tokens/s of each step after warm-up; stamps[0] is the start, stamps[k] the end of step k."""
    return [tokens[k] / max(stamps[k + 1] - stamps[k], 1e-9) for k in range(warmup, len(tokens))]


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import memfit.train.loop as loop

    watch = PeakWatch(spec["device"])
    import_rss = current_rss_bytes()
    stamps: list[float] = []
    tokens: list[int] = []
    metric_rates: list[float] = []
    peak_through_steps = [0]

    def on_record(record: dict[str, Any]) -> None:  # each step's end is timed when its metrics line is written
        if record.get("event") == "start":
            stamps.append(time.perf_counter())
        elif "event" not in record and "step" in record:
            synchronize(spec["device"])
            stamps.append(time.perf_counter())
            tokens.append(int(record["tokens"]))
            metric_rates.append(float(record["tokens_per_second"]))
            peak_through_steps[0] = watch.total()

    with instrumented_loop(loop, watch, on_record):
        return _memfit_run(spec, loop, watch, import_rss, stamps, tokens, metric_rates, peak_through_steps)


def _memfit_run(spec, loop, watch, import_rss, stamps, tokens, metric_rates, peak_through_steps) -> dict[str, Any]:
    from memfit.config_loading import load_config

    overrides = {
        "model": spec["model_dir"],
        "seq_len": spec["seq_len"],
        "batch_size": spec["batch_size"],
        "max_steps": spec["steps"],
        "seed": SEED,
        "lr": LR,
        "max_grad_norm": MAX_GRAD_NORM,
        "precision": "bf16" if spec["device"] == "cuda" else "fp32",
        "optimizer": "adamw",
        "gradient_checkpointing": "off",
        "loss_chunk_size": 0,
        "output_dir": spec["output_dir"],
        "cache_dir": spec["cache_dir"],
        "log_every": 10**6,
        **spec["overrides"],
    }
    result = loop.train(load_config(overrides={k: str(v) for k, v in overrides.items()}))
    rates = _step_rates(stamps, tokens, spec["warmup"])
    return {
        "tokens_per_second": median(rates),
        "step_rates": rates,
        "memfit_metric_tokens_per_second": median(metric_rates[spec["warmup"] :]),
        "peak_bytes": peak_through_steps[0],
        "import_rss_bytes": import_rss,
        "first_loss": result.losses[0],
        "final_loss": result.losses[-1],
        "ran": {
            key: result.summary.get(key)
            for key in ("precision", "optimizer", "attention", "gradient_checkpointing", "loss_chunk_size")
        },
    }


def hf_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from memfit.config import DataConfig
    from memfit.data import BatchSchedule, collate, load_training_data

    watch = PeakWatch(spec["device"])
    import_rss = current_rss_bytes()
    model_dir, batch_size, steps = spec["model_dir"], spec["batch_size"], spec["steps"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = load_training_data(DataConfig(seq_len=spec["seq_len"], cache_dir=spec["cache_dir"]), tokenizer)
    # memfit's sample order, so both trainers see the same samples at the same step.
    schedule = BatchSchedule(len(windows), batch_size, SEED)
    order = [int(i) for step in range(steps) for i in schedule.batch_indices(step)]

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(order)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return windows[order[index]]

    tokens = [
        sum(len(windows[i]["input_ids"]) for i in order[k * batch_size : (k + 1) * batch_size]) for k in range(steps)
    ]
    stamps: list[float] = []
    peak_through_steps = [0]
    losses: list[float] = []

    class Stamps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(spec["device"])
            stamps.append(time.perf_counter())
            peak_through_steps[0] = watch.total()

    class LossRecordingTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)  # the order is already memfit's

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    on_cuda = spec["device"] == "cuda"
    arguments = TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch_fused",
        bf16=on_cuda,
        use_cpu=not on_cuda,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=SEED,
    )
    trainer = LossRecordingTrainer(
        model=model,
        args=arguments,
        train_dataset=Samples(),
        data_collator=lambda samples: collate(samples, tokenizer.pad_token_id),
        callbacks=[Stamps()],
    )
    trainer.train()
    rates = _step_rates(stamps, tokens, spec["warmup"])
    return {
        "tokens_per_second": median(rates),
        "step_rates": rates,
        "peak_bytes": peak_through_steps[0],
        "import_rss_bytes": import_rss,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "ran": {"precision": "bf16" if on_cuda else "fp32", "optimizer": "adamw_torch_fused", "attention": "sdpa"},
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of HF Trainer and of the memfit baseline, alternated (default 2)"
    )
    parser.add_argument("--quick", action="store_true", help="toy model, seq-len 64, 3 steps: a smoke run in seconds")
    parser.add_argument(
        "--only", help="comma-separated configurations to run (default all): " + ", ".join(c[0] for c in CONFIGURATIONS)
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when present")
    parser.add_argument("--out", help="markdown file to write the results section into (e.g. docs/benchmarks.md)")
    parser.add_argument(
        "--label", help="title of this run's subsection in --out (default: the device, e.g. 'CPU, 2 cores')"
    )
    parser.add_argument("--json", help="also write the raw results of every run to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.seq_len, args.repeats = min(args.steps, 3), 1, 64, 1
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def run_all(args: argparse.Namespace, device: str, workdir: Path) -> tuple[dict[str, list[dict]], int]:
    shape = "quick" if args.quick else "20m"
    model_dir = workdir / "model"
    parameters = save_model(model_dir, shape, SEED)
    wanted = set(args.only.split(",")) if args.only else {c[0] for c in CONFIGURATIONS}
    configurations = [c for c in configurations_for(device) if c[0] in wanted]
    pair = [c for c in configurations if c[0] in REPEATED]
    others = [c for c in configurations if c[0] not in REPEATED]
    # HF, memfit, <the switches>, HF, memfit, ...: the pair spread over the whole run.
    plan = list(pair) + others + [c for _ in range(args.repeats - 1) for c in pair]
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    results: dict[str, list[dict]] = {c[0]: [] for c in configurations}
    specs = []
    for number, (name, _, kind, overrides) in enumerate(plan, 1):
        specs.append(
            {
                "name": name,
                "kind": kind,
                "model_dir": str(model_dir),
                "cache_dir": str(workdir / "cache"),
                "output_dir": str(workdir / f"run-{number}-{name}"),
                "steps": args.steps,
                "warmup": args.warmup,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "device": device,
                "overrides": overrides,
            }
        )
    # --quick: every run in this process, one after another (torch imported once; a smoke run). The device is the
    # spec's, so the worker's CUDA_VISIBLE_DEVICES is not needed for a CPU run here
    batch = [(memfit_worker if s["kind"] == "memfit" else hf_worker)(s) for s in specs] if args.quick else None
    for number, (name, label, _, _) in enumerate(plan, 1):
        started = time.perf_counter()
        result = batch[number - 1] if batch else run_worker(__file__, specs[number - 1], env=env)
        # The 1-minute load average as the run ends: timings on a shared machine are read beside it.
        result["load_average"] = os.getloadavg()[0]
        results[name].append(result)
        if args.json:  # kept up to date, so an interrupted run leaves what it measured
            Path(args.json).write_text(json.dumps({"runs": results}, indent=1))
        print(
            f"[{number}/{len(plan)}] {label}: {result['tokens_per_second']:.0f} tokens/s,"
            f" peak {result['peak_bytes'] / MIB:.0f} MiB, first loss {result['first_loss']:.4f}"
            f" ({time.perf_counter() - started:.0f} s, load average {result['load_average']:.1f})",
            file=sys.stderr,
        )
    return results, parameters


def summarize(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            "tokens_per_second": median([r["tokens_per_second"] for r in runs]),
            "peak_bytes": median([r["peak_bytes"] for r in runs]),
            "first_loss": median([r["first_loss"] for r in runs]),
            "import_rss_bytes": median([r["import_rss_bytes"] for r in runs]),
            "load_average": max(r.get("load_average", 0.0) for r in runs),
            "runs": len(runs),
            "ran": runs[0]["ran"],
        }
        for name, runs in results.items()
        if runs
    }


def fallback_note(overrides: dict[str, Any], ran: dict[str, Any]) -> str:
    """What ran instead of the switch asked for (a missing bitsandbytes, say), or ''."""
    notes = []
    if "optimizer" in overrides and not str(ran.get("optimizer", "")).startswith(overrides["optimizer"]):
        notes.append(f"optimizer {ran.get('optimizer')} ran")
    if "precision" in overrides and ran.get("precision") != overrides["precision"]:
        notes.append(f"precision {ran.get('precision')} ran")
    return f" ({'; '.join(notes)} instead)" if notes else ""


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}" if value and reference else "-"


def report(
    args: argparse.Namespace, device: str, summary: dict[str, dict[str, float]], parameters: int, command: str
) -> str:
    shape = MODEL_SHAPES["quick" if args.quick else "20m"]
    peak_name = "peak allocated (MiB)" if device == "cuda" else "peak RSS (MiB)"
    hf = summary.get("hf", {})
    rows = []
    for name, label, _, overrides in configurations_for(device):
        if name not in summary:
            continue
        figures = summary[name]
        runs = f" (median of {figures['runs']})" if figures["runs"] > 1 else ""
        rows.append(
            [
                label + runs + fallback_note(overrides, figures["ran"]),
                f"{figures['tokens_per_second']:.0f}",
                f"{figures['peak_bytes'] / MIB:.0f}",
                ratio(figures["tokens_per_second"], hf.get("tokens_per_second")),
                ratio(figures["peak_bytes"], hf.get("peak_bytes")),
                f"{figures['first_loss']:.4f}",
                f"{figures['load_average']:.1f}",
            ]
        )
    table = markdown_table(
        ["configuration", "tokens/s", peak_name, "tokens/s vs HF", "peak vs HF", "loss at step 1", "load"], rows
    )
    precision = "bf16 autocast" if device == "cuda" else "fp32"
    lines = [
        f"Model: Llama-shaped, {parameters / 1e6:.1f}M parameters ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, {shape['num_attention_heads']} heads, MLP {shape['intermediate_size']},"
        f" vocabulary {shape['vocab_size']}, tied embeddings), random init with a fixed seed, saved once and loaded"
        " by every run. Data: the bundled corpus through the byte tokenizer (ids < 257 of the"
        f" {shape['vocab_size']}-token embedding), packed windows of {args.seq_len} tokens, batch {args.batch_size}, no accumulation,"
        f" {args.steps} optimizer steps of which the first {args.warmup} are warm-up.",
        "",
        f"Both trainers: {precision}, fused AdamW (lr {LR:g}, betas {BETAS}, no weight decay), gradient clipping at"
        f" {MAX_GRAD_NORM:g}, cosine schedule, SDPA attention, the same samples in the same order. The Trainer runs"
        " with `optim=adamw_torch_fused`, no logging, evaluation or saving, `report_to=[]`. Each row is a fresh"
        + (
            " process; the reference and the baseline alternate and their figures are medians."
            if not args.quick
            else " --quick: every row in this script's process, one after another, so a row's peak is the highest"
            " so far."
        ),
        "",
        "tokens/s: median over the steps after warm-up of the step's tokens divided by the time from the end of"
        " the previous step to the end of this one (start-up and the end-of-run save excluded). load: the"
        f" machine's 1-minute load average as the row's runs ended (the largest over its runs; {os.cpu_count()}"
        " logical CPUs here): tokens/s measured under a load above that count are not a measurement of the trainer. "
        + (
            "Peak: `torch.cuda.max_memory_allocated` from process start to the end of the last step."
            if device == "cuda"
            else "Peak RSS: the process's VmHWM from its start to the end of its last step, so it includes"
            f" about {summary.get('baseline', hf).get('import_rss_bytes', 0) / MIB:.0f} MiB of Python, torch and"
            " transformers resident before the model is built."
        ),
        "",
        table,
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_description(device)}",
        "",
        f"Date: {today()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        if spec["kind"] == "batch":
            emit_result(
                {"results": [(memfit_worker if s["kind"] == "memfit" else hf_worker)(s) for s in spec["specs"]]}
            )
        else:
            emit_result((memfit_worker if spec["kind"] == "memfit" else hf_worker)(spec))
        return 0
    device = resolve_device(args.device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as workdir:
        results, parameters = run_all(args, device, Path(workdir))
    summary = summarize(results)
    command = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:] if argv is None else argv)
    body = report(args, device, summary, parameters, command.strip())
    print(body)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        write_section(args.out, SECTION, body, args.label or default_label(device))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""Preference tuning (DPO): memfit's `--task dpo` against TRL's DPOTrainer, peak memory and pairs/s.

    python benchmarks/bench_preference.py                             # ~23M Llama, synthetic pairs of 512 tokens, CPU
    python benchmarks/bench_preference.py --out docs/benchmarks.md    # also write the tables into the docs (own subsection)
    python benchmarks/bench_preference.py --data builtin              # builtin:preferences (50 pairs, up to 397 tokens)
    python benchmarks/bench_preference.py --longest 2GiB              # also: the longest pair one step fits in 2 GiB
    python benchmarks/bench_preference.py --quick                     # toy model, a smoke run in seconds

Needs TRL (`pip install 'memfit[bench]'`). CPU only, fp32 on both sides.

One Llama-shaped model (benchmarks/_common.py's "20m": 6 blocks of width 384, a 32000-token
vocabulary, tied embeddings) is built with a fixed seed and saved once with the byte tokenizer and
memfit's ChatML template as the tokenizer's own chat template, so both tools render the pairs with the
same template and make the same tokens. The pairs: by default a synthetic preference JSONL this script
writes (conversational, explicit prompt; every pair the same lengths: a prompt of --seq-len/8 tokens, a
chosen answer filling the pair to exactly --seq-len tokens, a rejected one of 60% of that), one pair
per sample of the run, so memory and time depend on the length and not on which pairs a step draws;
`--data builtin` uses the bundled `builtin:preferences` instead. Both tools train on the same pairs in
the same order (TRL's dataset is the pairs in memfit's schedule, read sequentially), with the same
max length (TRL's `max_length`, memfit's `--seq-len`; every pair fits, nothing is cut or dropped),
batch size (pairs a step, one micro-batch), steps, lr (constant schedule, no warm-up), AdamW (torch's
fused kernel, betas (0.9, 0.999), no weight decay, clipping at 1.0), beta, loss type, fp32, SDPA
attention. Each run is a fresh Python process; the two default runs alternate (TRL, memfit, the
others, TRL, memfit) and their figures are medians. (`--quick` runs everything in this script's process,
one run after another: a smoke run, whose peaks are the highest so far.) TRL's dataset holds the pairs of
the run's steps; with `--data builtin` memfit's cached reference covers all 50 pairs, TRL's precomputed one
those: a difference of start-up only.

Runs and what each side does:

- TRL's defaults: its reference a full frozen copy of the model (`ref_model=None`,
  `precompute_ref_log_probs=False`), `gradient_checkpointing=True` (DPOConfig's default), its fused
  LM head (log-probabilities in tiles, no full logits). Only the settings above are set (and
  `bf16=False`: DPOConfig's default is bf16 autocast, left out here to compare fp32 with fp32).
- memfit's defaults (`memfit train --task dpo`): the reference a frozen copy (what `--reference auto`
  picks for full training), no checkpointing, the log-probabilities chunked (1024 tokens).
- The same settings on both sides: memfit `--gradient-checkpointing full` beside TRL's defaults (both
  a frozen copy, checkpointing on); TRL `gradient_checkpointing=False` beside memfit's defaults (both
  a frozen copy, no checkpointing); TRL `precompute_ref_log_probs=True, gradient_checkpointing=False`
  beside memfit `--reference cached` (both the reference's log-probabilities computed once before
  training, no copy kept).

pairs/s: the median over the steps after warm-up of (pairs of the step) / (time from the end of the
previous step to the end of this one); pairs per CPU second the same with the process's CPU time (all
threads), which a busy machine disturbs less. Start-up (process start to the first step: imports,
loading, tokenizing, and for a cached reference its pass over the data) is left out of both and shown
apart. Peak: the process's peak resident memory (VmHWM) from its start to the end of its last step,
Python and libraries included; memfit resets VmHWM at each step, so its peak is read before every reset
(benchmarks/_common.py's PeakWatch). Ratios are memfit / TRL, within one run of this script.

`--longest CAP` (optional, coarse): for TRL's defaults, memfit's defaults and memfit
`--gradient-checkpointing full`, one step of one synthetic pair at each length of a doubling ladder
(--longest-lengths), each in a fresh process, until the peak passes CAP. Both sides are measured the
same way: the process's peak RSS (VmHWM) of that one step; a length fits when the step completes with
its peak within CAP. The longest fitting length of the ladder is reported, and an estimate between it
and the next ladder length by linear interpolation of the measured peaks (peak against length is close
to linear at these lengths). No limit is enforced on either side: memfit's `--memory-cap` caps the live
tensor bytes memfit tracks (what a GPU would hold), which TRL has no counterpart of, and an address-space
limit (RLIMIT_AS) stops a torch process far below its resident memory, so neither measures the two
tools alike.
"""

from __future__ import annotations

import argparse
import importlib.resources
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
    llama_config,
    markdown_table,
    median,
    run_worker,
    write_section,
)
from peer_runs import CPU_ONLY, Clock, longest_of, provenance, ratio, save_json, what_ran  # noqa: E402

SECTION = "Preference tuning (DPO): memfit and TRL's DPOTrainer"
MIB = 1024**2

# Settings both tools get (TRL's AdamW defaults; a constant lr so neither schedule differs).
LR, BETAS, EPS, MAX_GRAD_NORM, SEED = 5e-5, (0.9, 0.999), 1e-8, 1.0, 0

# (name, label, tool, settings). memfit settings are config overrides; TRL settings are DPOConfig fields.
CONFIGURATIONS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("trl", "TRL DPOTrainer, its defaults (frozen copy, checkpointing on)", "trl", {}),
    ("memfit", "memfit `--task dpo`, its defaults (frozen copy, no checkpointing)", "memfit", {}),
    ("trl-no-ckpt", "TRL `gradient_checkpointing=False`", "trl", {"gradient_checkpointing": False}),
    ("memfit-ckpt", "memfit `--gradient-checkpointing full`", "memfit", {"gradient_checkpointing": "full"}),
    ("trl-precompute", "TRL `precompute_ref_log_probs=True, gradient_checkpointing=False`", "trl",
     {"precompute_ref_log_probs": True, "gradient_checkpointing": False}),
    ("memfit-cached", "memfit `--reference cached`", "memfit", {"reference": "cached"}),
]
REPEATED = ("trl", "memfit")

# (what is compared, memfit run, TRL run): the ratios memfit / TRL.
COMPARISONS = [
    ("(1) each at its defaults: memfit's defaults / TRL's defaults", "memfit", "trl"),
    ("(2) same settings, frozen copy and checkpointing: memfit `--gradient-checkpointing full` / TRL's defaults",
     "memfit-ckpt", "trl"),
    ("(2) same settings, frozen copy, no checkpointing: memfit's defaults / TRL `gradient_checkpointing=False`",
     "memfit", "trl-no-ckpt"),
    ("(2) same settings, reference computed before training, no checkpointing: memfit `--reference cached` / TRL"
     " `precompute_ref_log_probs=True, gradient_checkpointing=False`", "memfit-cached", "trl-precompute"),
]

# --longest: the ladders (one step of one pair at each length).
LONGEST_SIDES = [("trl", "TRL's defaults"), ("memfit", "memfit's defaults"),
                 ("memfit-ckpt", "memfit `--gradient-checkpointing full`")]


# ---------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------


def chatml_template() -> str:
    return (importlib.resources.files("memfit.data") / "templates" / "chatml.jinja").read_text()


def save_model(directory: Path, shape: str, max_positions: int) -> tuple[int, Any]:
    """The model of `shape` (fixed seed) and the byte tokenizer with ChatML as its own template; returns the
    parameter count and the tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    from memfit.models.tiny import byte_tokenizer

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(shape, max_positions))
    model.save_pretrained(directory)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = chatml_template()
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()), tokenizer


WORDS = ("memory gradient batch token model layer training fits device loss step context offload answer "
         "reference policy chosen rejected reward margin preference the a of to and is in it").split()


def _text(rng: random.Random, characters: int) -> str:
    """ASCII words of exactly `characters` characters (one byte token each)."""
    words: list[str] = []
    size = 0
    while size < characters:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:characters].rstrip().ljust(characters, ".")


def pair_lengths(tokenizer: Any, record: dict) -> tuple[int, int, int]:
    """(prompt, prompt + chosen, prompt + rejected) tokens of a conversational record, rendered by the template."""
    def count(messages: list[dict], prompt: bool) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt,
                                                 return_dict=True)["input_ids"])

    prompt = count(record["prompt"], True)
    return prompt, count(record["prompt"] + record["chosen"], False), count(record["prompt"] + record["rejected"], False)


def synthetic_pairs(path: Path, tokenizer: Any, length: int, count: int) -> list[dict]:
    """`count` pairs whose longer sequence (prompt + chosen) is exactly `length` tokens; written as JSONL."""
    rng = random.Random(SEED)
    probe = {"prompt": [{"role": "user", "content": ""}], "chosen": [{"role": "assistant", "content": ""}],
             "rejected": [{"role": "assistant", "content": ""}]}
    prompt_overhead, chosen_overhead, _ = pair_lengths(tokenizer, probe)
    answer_overhead = chosen_overhead - prompt_overhead
    prompt_chars = max(8, length // 8 - prompt_overhead)
    chosen_chars = length - prompt_overhead - prompt_chars - answer_overhead
    if chosen_chars < 8:
        raise SystemExit(f"--seq-len {length} is too short for a synthetic pair (at least {length - chosen_chars + 8})")
    records = [{"prompt": [{"role": "user", "content": _text(rng, prompt_chars)}],
                "chosen": [{"role": "assistant", "content": _text(rng, chosen_chars)}],
                "rejected": [{"role": "assistant", "content": _text(rng, chosen_chars * 3 // 5)}]}
               for _ in range(count)]
    assert max(pair_lengths(tokenizer, records[0])[1:]) == length, "a synthetic pair is not --seq-len tokens"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def builtin_pairs(path: Path) -> list[dict]:
    text = (importlib.resources.files("memfit.data") / "chat" / "preferences.jsonl").read_text()
    path.write_text(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def schedule_order(pairs: int, batch_size: int, steps: int) -> list[int]:
    """The pairs memfit's schedule gives each step, in order (TRL reads its dataset in this order)."""
    from memfit.data import BatchSchedule

    schedule = BatchSchedule(pairs, batch_size, SEED)
    return [int(i) for step in range(steps) for i in schedule.batch_indices(step)]


# ---------------------------------------------------------------------------
# Workers: one run, in a fresh process
# ---------------------------------------------------------------------------


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    import memfit.train.loop as loop
    from memfit.config_loading import load_config

    clock = Clock()
    reference: dict[str, Any] = {}

    def on_record(record: dict[str, Any]) -> None:  # each step's end is stamped when its metrics line is written
        if record.get("event") == "start" or ("event" not in record and "step" in record):
            clock.tick()
        if record.get("event") == "start" and isinstance(record.get("task"), dict):
            reference.update(record["task"].get("reference") or {})

    overrides = {
        "model": spec["model_dir"], "dataset": spec["data"], "task": "dpo", "seq_len": spec["seq_len"],
        "batch_size": spec["batch_size"], "max_steps": spec["steps"], "seed": SEED, "lr": LR,
        "lr_schedule": "constant", "warmup_steps": 0, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
        "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM, "optimizer": "adamw", "precision": "fp32",
        "beta": spec["beta"], "loss_type": spec["loss_type"], "output_dir": spec["output_dir"],
        "cache_dir": spec["cache_dir"], "log_every": 10**6, "packing": spec.get("packing", "auto"),
        **spec["settings"],
    }
    with instrumented_loop(loop, clock.watch, on_record):
        result = loop.train(load_config(overrides={k: str(v) for k, v in overrides.items()}))
    out = clock.figures("pairs", spec["batch_size"], spec["warmup"], started) | {"losses": [float(x) for x in result.losses]}
    out["ran"] = {key: result.summary.get(key) for key in ("precision", "optimizer", "attention",
                                                           "gradient_checkpointing")}
    out["ran"]["reference"] = reference.get("mode")
    return out


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    clock = Clock()
    losses: list[float] = []
    records = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    ordered = Dataset.from_list([records[i] for i in spec["order"]])  # memfit's order, read sequentially

    class Stamps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.tick()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    arguments = DPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, max_length=spec["seq_len"],
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1, max_steps=spec["steps"],
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused",
        beta=spec["beta"], loss_type=[spec["loss_type"]], logging_strategy="no", save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=SEED,
        **spec["settings"],
    )
    trainer = InOrder(model=model, args=arguments, train_dataset=ordered, processing_class=tokenizer,
                      callbacks=[Stamps()])
    trainer.train()
    out = clock.figures("pairs", spec["batch_size"], spec["warmup"], started) | {"losses": losses}
    out["ran"] = {"precision": "fp32", "optimizer": getattr(arguments.optim, "value", arguments.optim), "attention": "sdpa",
                  "gradient_checkpointing": arguments.gradient_checkpointing,
                  "precompute_ref_log_probs": arguments.precompute_ref_log_probs,
                  "reference": "precomputed" if trainer.ref_model is None else "frozen copy"}
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    return (memfit_worker if spec["tool"] == "memfit" else trl_worker)(spec)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=("synthetic", "builtin"), default="synthetic",
                        help="synthetic pairs of exactly --seq-len tokens (default), or builtin:preferences")
    parser.add_argument("--seq-len", type=int, help="max length, and the synthetic pairs' length (default 512;"
                                                    " 448 with --data builtin, its longest pair being 397)")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of pairs/s (default 2)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta, both tools (default 0.1)")
    parser.add_argument("--loss-type", default="sigmoid", choices=("sigmoid", "hinge", "ipo", "robust"),
                        help="DPO's loss type, both tools (default sigmoid)")
    parser.add_argument("--packing", default="auto", choices=("auto", "samples", "off"),
                        help="memfit's --packing of each micro-batch's sequences (default auto: packed where their"
                             " lengths differ; TRL pads them); the synthetic pairs are all one length")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of TRL's defaults and of memfit's defaults, alternated (default 2)")
    parser.add_argument("--only", help="comma-separated runs (default all): " + ", ".join(c[0] for c in CONFIGURATIONS)
                        + "; 'none' with --longest for the ladder alone")
    parser.add_argument("--longest", metavar="CAP", help="also find the longest pair one step fits in CAP (e.g. 2GiB)")
    parser.add_argument("--longest-lengths", default="512,1024,2048,4096,8192",
                        help="the ladder of pair lengths for --longest (default 512,1024,2048,4096,8192)")
    parser.add_argument("--quick", action="store_true",
                        help="toy model, seq-len 128, batch 2, 3 steps, every run in this process: a smoke run")
    parser.add_argument("--out", help="markdown file to write the results section into (e.g. docs/benchmarks.md)")
    parser.add_argument("--label", help="title of this run's subsection in --out (default 'CPU, N cores')")
    parser.add_argument("--json", help="also write the raw results of every run to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 448 if args.data == "builtin" else 512
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch_size = min(args.steps, 3), 1, 1, min(args.batch_size, 2)
        if args.data == "synthetic":
            args.seq_len = 128
        if args.longest:
            args.longest_lengths = "128,256"
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.longest:
        from memfit.units import parse_size

        args.cap_bytes = parse_size(args.longest, "--longest")
        args.ladder = sorted(int(x) for x in args.longest_lengths.split(","))
    return args


def run_plan(args: argparse.Namespace, workdir: Path, model_dir: Path, data: Path, pairs: int,
             ) -> dict[str, list[dict]]:
    wanted = set(args.only.split(",")) if args.only else {c[0] for c in CONFIGURATIONS}
    configurations = [c for c in CONFIGURATIONS if c[0] in wanted]
    pair = [c for c in configurations if c[0] in REPEATED]
    others = [c for c in configurations if c[0] not in REPEATED]
    plan = list(pair) + others + [c for _ in range(args.repeats - 1) for c in pair]  # TRL, memfit, ..., TRL, memfit
    order = schedule_order(pairs, args.batch_size, args.steps)
    specs = [{"name": name, "tool": tool, "settings": settings, "model_dir": str(model_dir), "data": str(data),
              "order": order, "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
              "warmup": args.warmup, "beta": args.beta, "loss_type": args.loss_type, "packing": args.packing,
              "output_dir": str(workdir / f"run-{number}-{name}"), "cache_dir": str(workdir / f"cache-{number}")}
             for number, (name, _, tool, settings) in enumerate(plan, 1)]
    results: dict[str, list[dict]] = {c[0]: [] for c in configurations}
    for number, ((name, label, _, _), spec) in enumerate(zip(plan, specs, strict=True), 1):
        began = time.perf_counter()
        # --quick: every run in this process, one after another (torch and TRL imported once): a smoke run.
        result = worker(spec) if args.quick else run_worker(__file__, spec, timeout=3600, env=CPU_ONLY)
        result["load_average"] = os.getloadavg()[0]  # as the run ends: timings are read beside it
        results[name].append(result)
        save_json(args, {"runs": results})
        print(f"[{number}/{len(plan)}] {label}: {result['pairs_per_second']:.2f} pairs/s,"
              f" {result['pairs_per_cpu_second']:.2f} pairs/CPU s, peak {result['peak_bytes'] / MIB:.0f} MiB"
              f" ({time.perf_counter() - began:.0f} s, load average {result['load_average']:.1f})", file=sys.stderr)
    return results




def run_longest(args: argparse.Namespace, workdir: Path, model_dir: Path, tokenizer: Any) -> dict[str, list[dict]]:
    """One step of one synthetic pair at each ladder length, each side until its peak passes the cap."""
    ladder: dict[str, list[dict]] = {}
    settings = {name: (tool, values) for name, _, tool, values in CONFIGURATIONS}
    for name, label in LONGEST_SIDES:
        ladder[name] = []
        for length in args.ladder:
            data = workdir / f"longest-{length}.jsonl"
            if not data.exists():
                synthetic_pairs(data, tokenizer, length, 1)
            tool, values = settings[name]
            tag = f"longest-{name}-{length}"
            spec = {"name": tag, "tool": tool, "settings": values, "model_dir": str(model_dir), "data": str(data),
                    "order": [0], "seq_len": length, "batch_size": 1, "steps": 1, "warmup": 0, "beta": args.beta,
                    "loss_type": args.loss_type, "output_dir": str(workdir / tag), "cache_dir": str(workdir / tag / "c")}
            began = time.perf_counter()
            try:
                result = worker(spec) if args.quick else run_worker(__file__, spec, timeout=3600, env=CPU_ONLY)
                entry = {"length": length, "completed": True, "peak_bytes": result["peak_bytes"]}
            except (RuntimeError, MemoryError, subprocess.TimeoutExpired) as error:  # killed for memory, failed: over
                entry = {"length": length, "completed": False, "peak_bytes": None, "error": str(error)[-400:]}
            entry["fits"] = bool(entry["completed"] and entry["peak_bytes"] <= args.cap_bytes)
            ladder[name].append(entry)
            save_json(args, {"longest": ladder})
            peak = f"peak {entry['peak_bytes'] / MIB:.0f} MiB" if entry["peak_bytes"] else "failed"
            print(f"[longest] {label}, one pair of {length} tokens: {peak}, {'fits' if entry['fits'] else 'over'}"
                  f" {args.longest} ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
            if not entry["fits"]:
                break
    return ladder


def summarize(results: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    return peer_runs.summarize(results, ("pairs_per_second", "pairs_per_cpu_second"), loss_at_step_2=lambda runs: median(
        [r["losses"][1] for r in runs if len(r["losses"]) > 1]))


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
        f"**Longest pair within {args.longest}**",
        "",
        "One step of one synthetic pair (its longer sequence the length shown) at each length of the ladder, a"
        " fresh process each, a side stopping at its first length over the cap. A length fits when the step"
        f" completes with the process's peak RSS (VmHWM, from its start) within {args.longest}; the estimate"
        " interpolates the measured peaks linearly between the longest fitting length and the next. Nothing"
        " enforces the cap on either side: both are measured alike.",
        "",
        markdown_table(["run", "longest fitting length", "estimate", "peak RSS (MiB) at each length"], rows),
    ]
    for name, label in LONGEST_SIDES[1:]:
        (mine, mine_estimate), (theirs, theirs_estimate) = found.get(name, (None, None)), found.get("trl", (None, None))
        if mine_estimate and theirs_estimate:
            lines += ["", f"{label} / TRL's defaults, longest pair: {mine_estimate / theirs_estimate:.2f} (estimates),"
                          f" {mine / theirs:.2f} (ladder lengths)"]
        elif name in found and "trl" in found:
            lines += ["", f"{label} / TRL's defaults: no ratio, a side has no length over the cap or none within it"
                          " (give --longest-lengths that reach past both)"]
    return lines


def report(args: argparse.Namespace, summary: dict[str, dict[str, Any]], ladder: dict[str, list[dict]] | None,
           parameters: int, pair_facts: str, command: str, load_start: tuple[float, ...]) -> str:
    if not summary and ladder is not None:  # --only none: the ladder alone (write_longest's subsection)
        return "\n".join([*longest_report(args, ladder), *provenance(command, load_start)])
    shape = MODEL_SHAPES["quick" if args.quick else "20m"]
    rows = []
    for name, label, _, _ in CONFIGURATIONS:
        if name not in summary:
            continue
        f = summary[name]
        runs = f" (median of {f['runs']})" if f["runs"] > 1 else ""
        rows.append([label + runs, f"{f['pairs_per_second']:.2f}", f"{f['pairs_per_cpu_second']:.2f}",
                     f"{f['peak_bytes'] / MIB:.0f}", f"{f['startup_seconds']:.0f}",
                     f"{f['loss_at_step_2']:.5f}" if f["loss_at_step_2"] is not None else "-",
                     f"{f['load_average']:.1f}"])
    comparisons = []
    for what, mine, theirs in COMPARISONS:
        if mine in summary and theirs in summary:
            m, t = summary[mine], summary[theirs]
            comparisons.append([what, ratio(m["peak_bytes"], t["peak_bytes"]),
                                ratio(m["pairs_per_second"], t["pairs_per_second"]),
                                ratio(m["pairs_per_cpu_second"], t["pairs_per_cpu_second"])])
    data = ("synthetic conversational pairs (an explicit prompt; " + pair_facts + ")" if args.data == "synthetic"
            else "`builtin:preferences` (" + pair_facts + ")")
    import_rss = {tool: summary[name]["import_rss_bytes"] / MIB for tool, name in (("TRL", "trl"), ("memfit", "memfit"))
                  if name in summary}
    lines = [
        f"Model: Llama-shaped, {parameters / 1e6:.1f}M parameters ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, {shape['num_attention_heads']} heads, MLP {shape['intermediate_size']}, vocabulary"
        f" {shape['vocab_size']}, tied embeddings), random init with a fixed seed, saved once with the byte tokenizer"
        " and ChatML as its chat template. Data: " + data + f", both tools rendering them with that template; max"
        f" length {args.seq_len}, {args.batch_size} pairs a step (one micro-batch), {args.steps} steps (warm-up, left"
        f" out of pairs/s: {args.warmup}), the same pairs in the same order. DPO: beta {args.beta:g}, loss type"
        f" {args.loss_type}. Both: fp32, SDPA attention, fused AdamW (lr {LR:g} constant, betas {BETAS}, no weight"
        f" decay), clipping at {MAX_GRAD_NORM:g}.",
        "",
        "TRL's defaults: its reference a full frozen copy (`precompute_ref_log_probs=False`) and"
        " `gradient_checkpointing=True`, its fused LM head; `bf16=False` set (its default is bf16). memfit's"
        " defaults: the reference a frozen copy, no checkpointing, log-probabilities in chunks whose logits are"
        " about the size of the batch's hidden states (64 tokens here), over the answers' positions only."
        + (" Each row a fresh process; the two default runs alternate and their figures are medians."
           if not args.quick else " --quick: every row in this script's process, one after another, so a row's peak"
           " is the highest so far."),
        "",
        "pairs/s: median over the steps after warm-up of the step's pairs divided by the time from the end of the"
        " previous step to the end of this one; pairs/CPU s the same over the process's CPU time. start-up: process"
        " start to the first step (imports, loading, tokenizing, a precomputed reference's pass). Peak RSS: the"
        " process's VmHWM from its start to the end of its last step, including what Python and the libraries hold"
        " before the model is loaded (" + ", ".join(f"{tool} about {v:.0f} MiB" for tool, v in import_rss.items())
        + "). load: the 1-minute load average as the row's runs ended (the largest over its runs;"
        f" {os.cpu_count()} logical CPUs here). DPO's loss is log 2 at step 1 for both (the policy is the"
        " reference); at step 2 it shows that both made the same update.",
        "",
        markdown_table(["run", "pairs/s", "pairs/CPU s", "peak RSS (MiB)", "start-up (s)", "loss at step 2", "load"],
                       rows),
        "",
        what_ran(summary, CONFIGURATIONS),
        "",
        "Ratios, memfit / TRL (peak below 1: memfit holds less; pairs/s above 1: memfit is faster):",
        "",
        markdown_table(["comparison", "peak RSS", "pairs/s", "pairs/CPU s"], comparisons),
    ]
    if ladder is not None:
        lines += ["", *longest_report(args, ladder)]
    lines += provenance(command, load_start)
    return "\n".join(lines)


def describe_pairs(tokenizer: Any, records: list[dict]) -> str:
    lengths = [max(pair_lengths(tokenizer, r)[1:]) for r in records]
    return (f"{len(records)} pairs, pair length (the longer of prompt + chosen and prompt + rejected) median"
            f" {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)} tokens")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    import importlib.util

    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"bench_preference needs {' and '.join(missing)}: pip install 'memfit[bench]'")
    if args.quick:  # the runs in this process: on the CPU, as the workers
        os.environ.update(CPU_ONLY)
    load_start = os.getloadavg()
    started = time.perf_counter()
    shape = "quick" if args.quick else "20m"
    with tempfile.TemporaryDirectory(prefix="memfit-bench-dpo-") as scratch:
        workdir = Path(scratch)
        model_dir = workdir / "model"
        positions = max([2048, args.seq_len, *(getattr(args, "ladder", None) or [])])
        parameters, tokenizer = save_model(model_dir, shape, positions)
        data = workdir / "pairs.jsonl"
        records = (synthetic_pairs(data, tokenizer, args.seq_len, args.steps * args.batch_size)
                   if args.data == "synthetic" else builtin_pairs(data))
        too_long = max(max(pair_lengths(tokenizer, r)[1:]) for r in records)
        if too_long > args.seq_len:
            sys.exit(f"--seq-len {args.seq_len} cuts pairs of {too_long} tokens: give at least {too_long}")
        pair_facts = describe_pairs(tokenizer, records)
        results = ({} if args.only == "none" else run_plan(args, workdir, model_dir, data, len(records)))
        ladder = run_longest(args, workdir, model_dir, tokenizer) if args.longest else None
    summary = summarize(results)
    command = "python benchmarks/bench_preference.py " + " ".join(sys.argv[1:] if argv is None else argv)
    body = report(args, summary, ladder, parameters, pair_facts, command.strip(), load_start)
    print(body)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        label = args.label or default_label("cpu")
        if not results and ladder is not None:  # the runs' subsection is kept; the ladder gets one of its own
            label += f", longest pair within {args.longest}"
        write_section(args.out, SECTION, body, label)
    save_json(args, {"summary": summary})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

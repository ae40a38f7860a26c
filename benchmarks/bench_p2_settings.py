"""Which memfit settings beat the Hugging Face Trainer at P2's memory budget, measured one by one.

    python benchmarks/bench_p2_settings.py --budget-mib 697 --threads 1
    python benchmarks/bench_p2_settings.py --settings mb4-chunked,mb4-chunked-compile --passes 2 --json a.json
    python benchmarks/bench_p2_settings.py --aggregate a.json b.json    # one table from earlier runs

P2 (`bench_peers.py p2`) gives memfit and the Trainer the same budget of live tensor bytes
and compares the fastest setting each one picks. This script asks the question behind it:
for each memfit setting (micro-batch, chunked loss, optimizer in backward, `--compile`,
pure bf16 weights), does it fit the budget, and how fast is it next to the Trainer's
fastest fitting setting (micro-batch 1 x 4, bf16 autocast, fused AdamW)?

- Fit: one run of the setting under `--memory-cap` (memfit's tracker counts every live
  tensor storage, the budget's unit in P2) reports its tracked peak and whether it had to
  recover from out of memory (then it does not fit as given).
- Speed: timed runs without the cap, each between two runs of the Trainer reference and
  counted as its ratio to their mean, so a load that drifts on a shared machine cancels.
  With `--passes 2` the second pass runs the settings in reverse order; the median ratio
  is reported. Each run also reports tokens per CPU second (the process's CPU time, one
  thread): on a machine shared with other jobs it leaves out the time the others held the
  cores, which wall-clock ratios only partly cancel.

Every run is a fresh process (bench_peers.py's workers: the same model, samples, clocks).
A compiled setting is capped in its eager form: torch.compile runs the blocks eager under
memfit's tracker (Dynamo does not trace under a Python dispatch mode). `--aggregate`
tables the runs of several JSON files together: each setting's median ratio, its tracked
peak, and the planner's estimate and predicted order (`memfit plan`'s speed model), with
Spearman's rank correlation between predicted and measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _common import MODEL_SHAPES, machine_description, markdown_table, median, save_model, today

sys.path.insert(0, str(Path(__file__).parent))
import bench_peers  # noqa: E402  (the workers and their runner)

MIB = 1024**2
CHUNK = 1024
# name: (description, memfit overrides); all bf16 autocast ("amp") with fp32 weights unless the name says bf16
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mb1": ("1 x 4, full logits", {"batch_size": 1, "gradient_accumulation_steps": 4, "loss_chunk_size": 0}),
    "mb1-compile": ("1 x 4, full logits, --compile",
                    {"batch_size": 1, "gradient_accumulation_steps": 4, "loss_chunk_size": 0, "compile": True}),
    "mb2-chunked": ("2 x 2, chunked loss", {"batch_size": 2, "gradient_accumulation_steps": 2,
                                            "loss_chunk_size": CHUNK}),
    "mb2-chunked-compile": ("2 x 2, chunked loss, --compile",
                            {"batch_size": 2, "gradient_accumulation_steps": 2, "loss_chunk_size": CHUNK,
                             "compile": True}),
    "mb1-compile-loss": ("1 x 4, full logits, --compile and the loss function compiled (experiment)",
                         {"batch_size": 1, "gradient_accumulation_steps": 4, "loss_chunk_size": 0, "compile": True,
                          "compile_loss": True}),
    "mb4-chunk256-oib-compile-loss": ("4 x 1, chunked loss 256, optimizer in backward, --compile and the loss"
                                      " function compiled (experiment)",
                                      {"batch_size": 4, "loss_chunk_size": 256, "optimizer_in_backward": True,
                                       "max_grad_norm": 0.0, "compile": True, "compile_loss": True}),
    "mb4": ("4 x 1, full logits", {"batch_size": 4, "loss_chunk_size": 0}),
    "mb4-chunk256": ("4 x 1, chunked loss 256", {"batch_size": 4, "loss_chunk_size": 256}),
    "mb4-compile": ("4 x 1, full logits, --compile", {"batch_size": 4, "loss_chunk_size": 0, "compile": True}),
    "mb4-chunk256-compile": ("4 x 1, chunked loss 256, --compile",
                             {"batch_size": 4, "loss_chunk_size": 256, "compile": True}),
    "mb4-chunk256-selective": ("4 x 1, chunked loss 256, selective checkpointing",
                               {"batch_size": 4, "loss_chunk_size": 256, "gradient_checkpointing": "selective"}),
    "mb4-chunk256-selective-compile": ("4 x 1, chunked loss 256, selective checkpointing, --compile",
                                       {"batch_size": 4, "loss_chunk_size": 256,
                                        "gradient_checkpointing": "selective", "compile": True}),
    "mb4-chunked": ("4 x 1, chunked loss", {"batch_size": 4, "loss_chunk_size": CHUNK}),
    "mb4-chunked-oib": ("4 x 1, chunked loss, optimizer in backward",
                        {"batch_size": 4, "loss_chunk_size": CHUNK, "optimizer_in_backward": True,
                         "max_grad_norm": 0.0}),
    "mb4-chunked-compile": ("4 x 1, chunked loss, --compile",
                            {"batch_size": 4, "loss_chunk_size": CHUNK, "compile": True}),
    "mb4-chunked-oib-compile": ("4 x 1, chunked loss, optimizer in backward, --compile",
                                {"batch_size": 4, "loss_chunk_size": CHUNK, "optimizer_in_backward": True,
                                 "max_grad_norm": 0.0, "compile": True}),
    "mb4-chunk256-oib": ("4 x 1, chunked loss 256, optimizer in backward",
                         {"batch_size": 4, "loss_chunk_size": 256, "optimizer_in_backward": True,
                          "max_grad_norm": 0.0}),
    "mb4-chunk256-oib-compile": ("4 x 1, chunked loss 256, optimizer in backward, --compile",
                                 {"batch_size": 4, "loss_chunk_size": 256, "optimizer_in_backward": True,
                                  "max_grad_norm": 0.0, "compile": True}),
    "mb2-chunk256": ("2 x 2, chunked loss 256", {"batch_size": 2, "gradient_accumulation_steps": 2,
                                                  "loss_chunk_size": 256}),
    "mb2-chunk256-compile": ("2 x 2, chunked loss 256, --compile",
                             {"batch_size": 2, "gradient_accumulation_steps": 2, "loss_chunk_size": 256,
                              "compile": True}),
    "mb4-chunk256-full": ("4 x 1, chunked loss 256, full checkpointing",
                          {"batch_size": 4, "loss_chunk_size": 256, "gradient_checkpointing": "full"}),
    "mb4-chunk256-full-compile": ("4 x 1, chunked loss 256, full checkpointing, --compile",
                                  {"batch_size": 4, "loss_chunk_size": 256, "gradient_checkpointing": "full",
                                   "compile": True}),
    "mb4-chunked-selective": ("4 x 1, chunked loss, selective checkpointing",
                              {"batch_size": 4, "loss_chunk_size": CHUNK, "gradient_checkpointing": "selective"}),
    "mb4-chunked-selective-compile": ("4 x 1, chunked loss, selective checkpointing, --compile",
                                      {"batch_size": 4, "loss_chunk_size": CHUNK,
                                       "gradient_checkpointing": "selective", "compile": True}),
    "mb4-chunked-full": ("4 x 1, chunked loss, full checkpointing",
                         {"batch_size": 4, "loss_chunk_size": CHUNK, "gradient_checkpointing": "full"}),
    "mb4-chunked-full-compile": ("4 x 1, chunked loss, full checkpointing, --compile",
                                 {"batch_size": 4, "loss_chunk_size": CHUNK, "gradient_checkpointing": "full",
                                  "compile": True}),
    "mb4-chunked-bf16": ("4 x 1, chunked loss, pure bf16 weights",
                         {"batch_size": 4, "loss_chunk_size": CHUNK, "dtype": "bf16", "precision": "bf16"}),
    "mb4-chunked-bf16-compile": ("4 x 1, chunked loss, pure bf16 weights, --compile",
                                 {"batch_size": 4, "loss_chunk_size": CHUNK, "dtype": "bf16", "precision": "bf16",
                                  "compile": True}),
}
REFERENCE = ("Trainer bs 1 x 4, bf16", {"batch_size": 1, "gradient_checkpointing": False,
                                         "optim": "adamw_torch_fused", "bf16": True})


def _runner(args: argparse.Namespace, workdir: Path, model_dir: Path, steps: int, warmup: int) -> bench_peers.Runner:
    ns = SimpleNamespace(steps=steps, warmup=warmup, seq_len=args.seq_len, effective_batch=args.effective_batch,
                         threads=args.threads, json=None)
    return bench_peers.Runner(ns, "cpu", workdir, model_dir)


def predicted(names: list[str], seq_len: int) -> dict[str, tuple[float, int]]:
    """The planner's predicted tokens/s and estimated peak bytes of each setting (speed_model, estimator)."""
    from _common import llama_config

    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate
    from memfit.prediction.speed_model import estimated_step_seconds

    hf_config = llama_config("20m")
    found = {}
    for name in names:
        changes = {"precision": "amp", "gradient_accumulation_steps": 1, "loss_chunk_size": 0,
                   "gradient_checkpointing": "off", **SETTINGS[name][1]}
        config = load_config(overrides={"model": "tiny", "seq_len": str(seq_len),
                                        **{k: str(v) for k, v in changes.items()}})
        est = estimate(config, hf_config=hf_config)
        seconds = estimated_step_seconds(changes, config, est, None, hf_config)
        tokens = changes["batch_size"] * changes["gradient_accumulation_steps"] * seq_len
        found[name] = (tokens / seconds, est.peak_bytes)
    return found


def aggregate(paths: list[str], budget: int, seq_len: int) -> str:
    """One table from the JSON files of earlier runs: each setting's median ratio (tokens per CPU second) to its
    paired Trainer reference over every run of it, its tracked peak where a capped run measured it, and the
    planner's estimate and predicted order (Spearman's rank correlation against the measured one)."""
    from bench_speed_ranking import spearman

    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    fit: dict[str, dict[str, Any]] = {}
    for path in paths:
        raw = json.loads(Path(path).read_text())
        fit.update(raw.get("fit", {}))
        for entry in raw["timed"]:
            run, before, after = entry["run"], entry["reference_before"], entry["reference_after"]
            cpu.setdefault(entry["name"], []).append(
                run["tokens_per_cpu_second"] / ((before["tokens_per_cpu_second"] + after["tokens_per_cpu_second"]) / 2))
            wall.setdefault(entry["name"], []).append(
                run["tokens_per_second"] / ((before["tokens_per_second"] + after["tokens_per_second"]) / 2))
    # the planner does not know the experiments (compile_loss is not a memfit option): their own runs' tables show them
    names = [n for n in SETTINGS if n in cpu and "compile_loss" not in SETTINGS[n][1]]
    model = predicted(names, seq_len)
    base = model[names[0]][0]
    rows = []
    for name in sorted(names, key=lambda n: -median(cpu[n])):
        # a compiled setting's tracked peak is its eager form's (torch.compile runs eager under the tracker)
        f = fit.get(name) or fit.get(name.replace("-compile", "")) or fit.get(f"{name}-compile")
        if f is None:
            fits = "-"
        elif "error" in f:
            fits = "no (out of memory)"
        elif f["oom_events"]:
            fits = f"no (recovered at micro-batch {f['ran']['micro_batch_size']})"
        else:
            fits = f"yes, {f['tracked_peak_bytes'] / MIB:.0f} MiB" if f["tracked_peak_bytes"] <= budget else "no"
        speed, peak = model[name]
        planner_fits = "yes" if peak <= budget * 0.95 else "no"
        rows.append([SETTINGS[name][0], fits, f"{peak / MIB:.0f} ({planner_fits})", f"{speed / base:.2f}",
                     f"{median(cpu[name]):.2f}", ", ".join(f"{v:.2f}" for v in cpu[name]),
                     f"{median(wall[name]):.2f}"])
    rho = spearman([model[n][0] for n in names], [median(cpu[n]) for n in names])
    return "\n".join([
        f"**Spearman rank correlation, predicted vs measured (tokens per CPU second): {rho:.2f}** over"
        f" {len(names)} settings.",
        "",
        markdown_table(["memfit setting (bf16 autocast)", "tracked peak under the cap", "planner's estimate, MiB"
                        " (fits with its 5 % margin)", f"predicted vs {SETTINGS[names[0]][0]}",
                        f"measured vs {REFERENCE[0]}, tokens per CPU second (median)", "per run",
                        "measured, tokens/s (median)"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=697.0,
                        help="live tensor budget (P2's: half the plain Trainer run's tracked peak, 697 MiB)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--effective-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timed median (compile included)")
    parser.add_argument("--passes", type=int, default=1, help="timed passes (the second reversed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-fit-check", action="store_true", help="skip the capped runs")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--aggregate", nargs="+", metavar="JSON", help="run nothing: one table from earlier --json files")
    args = parser.parse_args(argv)
    if args.aggregate:
        print(aggregate(args.aggregate, int(args.budget_mib * MIB), args.seq_len))
        print("\nCommand: `python benchmarks/bench_p2_settings.py " + " ".join(argv if argv is not None else sys.argv[1:])
              + "`")
        return 0
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"bench_p2_settings.py: unknown setting(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    budget = int(args.budget_mib * MIB)
    load_start = os.getloadavg()
    raw: dict[str, Any] = {"fit": {}, "timed": []}
    with tempfile.TemporaryDirectory(prefix="memfit-p2s-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        parameters = save_model(model_dir, "20m", bench_peers.SEED)
        fit: dict[str, dict[str, Any]] = {}
        if not args.no_fit_check:
            capped = _runner(args, workdir, model_dir, steps=2, warmup=0)
            for name in names:
                overrides = {"precision": "amp", **SETTINGS[name][1]}
                try:
                    fit[name] = capped.run("memfit", f"{name} capped", overrides, cap_bytes=budget)
                except RuntimeError as error:  # out of memory that recovery could not split
                    last = str(error).strip().splitlines()
                    fit[name] = {"error": next((line for line in reversed(last) if "memory" in line), last[-1])}
                    print(f"{name} capped: {fit[name]['error']}", file=sys.stderr)
                raw["fit"][name] = fit[name]
                print(f"  {name}: ran {fit[name].get('ran')}, out-of-memory recoveries {fit[name].get('oom_events')}",
                      file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
        timed = _runner(args, workdir, model_dir, steps=args.steps, warmup=args.warmup)
        ratios: dict[str, list[float]] = {n: [] for n in names}
        cpu_ratios: dict[str, list[float]] = {n: [] for n in names}
        rates: dict[str, list[float]] = {n: [] for n in names}
        references: list[float] = []
        for p in range(args.passes):
            order = names if p % 2 == 0 else names[::-1]
            before = timed.run("hf", REFERENCE[0], REFERENCE[1])
            references.append(before["tokens_per_second"])
            for name in order:
                run = timed.run("memfit", name, {"precision": "amp", **SETTINGS[name][1]})
                after = timed.run("hf", REFERENCE[0], REFERENCE[1])
                references.append(after["tokens_per_second"])
                for key, into in (("tokens_per_second", ratios), ("tokens_per_cpu_second", cpu_ratios)):
                    into[name].append(run[key] / ((before[key] + after[key]) / 2))
                rates[name].append(run["tokens_per_second"])
                raw["timed"].append({"name": name, "pass": p, "run": run, "reference_before": before,
                                     "reference_after": after})
                before = after
                if args.json:
                    Path(args.json).write_text(json.dumps(raw, indent=1))
    load_end = os.getloadavg()
    rows = []
    for name in names:
        f = fit.get(name)
        tracked = f"{f['tracked_peak_bytes'] / MIB:.0f}" if f and f.get("tracked_peak_bytes") else "-"
        if not f:
            fits = "-"
        elif "error" in f:
            fits = "no (out of memory, no recovery)"
        elif f["oom_events"]:
            fits = f"no ({f['oom_events']} out-of-memory recoveries, ran micro-batch {f['ran']['micro_batch_size']})"
        else:
            fits = "yes" if f["tracked_peak_bytes"] <= budget else "no"
        timed_cells = ([f"{median(rates[name]):.0f}", f"{median(ratios[name]):.2f}", f"{median(cpu_ratios[name]):.2f}"]
                       if ratios[name] else ["-", "-", "-"])
        rows.append([SETTINGS[name][0], tracked, fits, *timed_cells,
                     ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(ratios[name], cpu_ratios[name], strict=True))])
    shape = MODEL_SHAPES["20m"]
    text = "\n".join([
        f"Model: {parameters / 1e6:.1f}M-parameter Llama ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, vocabulary {shape['vocab_size']}), seq {args.seq_len}, {args.effective_batch}"
        f" samples per step, bf16 autocast unless the row says pure bf16; {args.steps} steps per timed run of which"
        f" {args.warmup} warm-up; {args.threads} thread(s); budget {budget / MIB:.0f} MiB of live tensors.",
        "",
        markdown_table(["memfit setting", "tracked peak under the cap (MiB)", "fits", "tokens/s",
                        f"tokens/s vs {REFERENCE[0]}", "tokens per CPU second vs the same",
                        "ratio per pass (wall / CPU)"], rows),
        "",
        f"Reference ({REFERENCE[0]}, untracked): {len(references)} runs, {min(references):.0f} to"
        f" {max(references):.0f} tokens/s." if references else "No timed runs.",
        "",
        "Command: `python benchmarks/bench_p2_settings.py " + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
        f"Machine: {machine_description('cpu')}; load average (1 min) {load_start[0]:.1f} at the start,"
        f" {load_end[0]:.1f} at the end",
        "",
        f"Date: {today()}",
    ])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DNALLM's fine-tuning (the Hugging Face Trainer, every sequence padded to max_length) against memfit on a DNA-like
sequence-classification task: samples/s and peak memory in one run, and the longest sequence each fits under one cap.

The task: a CSV of A/C/G/T sequences of varied length (log-uniform up to --max-length), the label whether a motif
occurs (learnable), and a small ESM-like encoder (rotary positions, as Nucleotide Transformer v2) saved with a
character-level tokenizer. Both tools train the same saved model on the same rows with DNALLM's defaults (batch 8,
AdamW, lr 2e-5, weight decay 0.01, warmup ratio 0.1, linear schedule, clipping at 1.0, fp32 on a CPU).

- Throughput: the Trainer as DNALLM sets it up (tokenizer padding="max_length", truncation, its collator) against
  `memfit.train` (padding to the longest sample of each micro-batch, --group-by-length). samples/s is the median
  over the steps after --warmup; peak memory is memfit's live-tensor tracker (memfit.memory.tracker) attached the
  same way to both, in a separate short run, and the process peak RSS of the timed run beside it.
- Longest sequence under one cap: every row `L` tokens long, effective batch 8, one optimizer step under an
  emulated cap on live tensor bytes (the tracker's `cap_bytes`, what `--memory-cap` sets on a CPU). The Trainer
  runs as DNALLM sets it up; memfit runs with its cap and what it does under it (OOM recovery splits the
  micro-batch, keeps the update exact, and turns on full checkpointing when one sample does not fit; --memfit-mode
  plan lets the planner choose instead). `L` doubles from --fit-start until a run fails, then bisects twice.

Each measured run is a fresh Python process (its RSS its own); --quick runs tiny sizes in this process, for the
smoke test. Usage:

    python benchmarks/bench_dnallm.py --out docs/benchmarks.md       # full run (about 15 minutes on 2 idle cores)
    python benchmarks/bench_dnallm.py --quick                         # seconds
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result, machine_description, markdown_table, median, run_worker, today, write_section  # noqa: E402

BASES = "ACGT"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MOTIF = "TATAAT"
SEED = 42
# DNALLM's fine-tuning defaults (its configuration generator's finetune: section).
DNALLM = {"batch_size": 8, "lr": 2e-5, "weight_decay": 0.01, "warmup_ratio": 0.1, "lr_schedule": "linear",
          "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "max_grad_norm": 1.0}

FULL = {"hidden": 64, "layers": 4, "heads": 4, "max_length": 512, "rows": 64, "min_length": 32, "steps": 6,
        "warmup": 2, "fit_start": 64, "fit_steps": 1, "fit_max": 4096, "bisections": 1,
        "tracked_run": True}
# The smoke test's sizes: one timed run a tool (tracked in the same run) and two lengths under the cap.
QUICK = {"hidden": 32, "layers": 2, "heads": 4, "max_length": 64, "rows": 16, "min_length": 16, "steps": 2,
         "warmup": 1, "fit_start": 32, "fit_steps": 1, "fit_max": 64, "bisections": 0,
         "tracked_run": False}


# ---------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------


def save_model(directory: Path, shape: dict[str, Any]) -> None:
    """A small ESM-like masked-LM encoder with a character-level DNA tokenizer, saved with safetensors."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import EsmConfig, EsmForMaskedLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(BASES) + ["N"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    config = EsmConfig(vocab_size=len(vocab), hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                       num_attention_heads=shape["heads"], intermediate_size=4 * shape["hidden"],
                       max_position_embeddings=shape["fit_max"] + 2, position_embedding_type="rotary",
                       token_dropout=False, pad_token_id=0, mask_token_id=4, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    torch.manual_seed(SEED)
    EsmForMaskedLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def write_rows(path: Path, count: int, min_length: int, max_length: int, seed: int = SEED,
               fixed: int | None = None) -> Path:
    """`count` sequences (length log-uniform in [min, max - 2] bases, or `fixed`), label 1 when the motif occurs."""
    rng = random.Random(seed)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sequence", "label"])
        for i in range(count):
            bases = fixed if fixed is not None else int(math.exp(rng.uniform(math.log(min_length), math.log(max_length - 2))))
            sequence = [rng.choice(BASES) for _ in range(bases)]
            label = i % 2
            if label:
                at = rng.randrange(0, max(1, bases - len(MOTIF)))
                sequence[at : at + len(MOTIF)] = MOTIF
            writer.writerow(["".join(sequence)[:bases], label])
    return path


# ---------------------------------------------------------------------------
# Workers (one measured run each)
# ---------------------------------------------------------------------------


def _peak_rss() -> int:
    from memfit.memory.stats import process_peak_rss_bytes

    return int(process_peak_rss_bytes() or 0)


def hf_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The Trainer as DNALLM sets it up; with spec["cap"] or spec["track"], under memfit's tracker."""
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from memfit.memory.cap import is_out_of_memory
    from memfit.memory.tracker import MemoryTracker

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    with open(spec["data"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    # DNALLM's tokenization: every sequence padded (and cut) to max_length.
    encoded = tokenizer([r["sequence"] for r in rows], padding="max_length", truncation=True,
                        max_length=spec["max_length"])
    samples = [{"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i],
                "labels": int(rows[i]["label"])} for i in range(len(rows))]
    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=2)
    stamps: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    arguments = TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=DNALLM["batch_size"], max_steps=spec["steps"],
        learning_rate=DNALLM["lr"], weight_decay=DNALLM["weight_decay"], warmup_steps=DNALLM["warmup_ratio"],  # a ratio below 1
        lr_scheduler_type=DNALLM["lr_schedule"], adam_beta1=DNALLM["beta1"], adam_beta2=DNALLM["beta2"],
        adam_epsilon=DNALLM["eps"], max_grad_norm=DNALLM["max_grad_norm"], use_cpu=True, seed=SEED,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=samples,
                      data_collator=DataCollatorWithPadding(tokenizer), callbacks=[Stamps()])
    tracker = None
    if spec.get("cap") or spec.get("track"):
        tracker = MemoryTracker("cpu", cap_bytes=spec.get("cap"))
        tracker.attach(model)
    started = time.perf_counter()
    try:
        if tracker is not None:
            with tracker:
                trainer.train()
        else:
            trainer.train()
    except Exception as error:  # the cap's OutOfMemoryError: this length does not fit
        if not is_out_of_memory(error):
            raise
        return {"fits": False, "tracked_peak_bytes": tracker.peak_bytes if tracker else None}
    return {"fits": True, "samples_per_second": _rate([started, *stamps], spec["warmup"]),
            "tracked_peak_bytes": tracker.peak_bytes if tracker else None, "rss_peak_bytes": _peak_rss(),
            "ran": "Trainer, padding to max_length, batch 8"}


def memfit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """`memfit.train` on the same rows; with spec["cap"]: `--memory-cap` (and the planner under --memfit-mode plan)."""
    from memfit.config_loading import load_config
    from memfit.errors import DoesNotFitError
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics
    from memfit.train.planned import apply_plan_if_asked

    overrides = {"model": spec["model_dir"], "dataset": spec["data"], "task": "sequence-classification",
                 "seq_len": spec["max_length"], "max_steps": spec["steps"], "seed": SEED,
                 "output_dir": spec["output_dir"], "report": False, "log_every": 10**6,
                 "group_by_length": True, **{k: v for k, v in DNALLM.items()}}
    if spec.get("track"):
        overrides["track_memory"] = True
    if spec.get("cap"):
        overrides["memory_cap"] = spec["cap"]
        if spec.get("mode") == "plan":
            overrides["memory_budget"] = spec["cap"]
    config = load_config(overrides=overrides)
    try:
        result = train(apply_plan_if_asked(config))
    except DoesNotFitError:
        return {"fits": False}
    steps = [r for r in read_metrics(Path(spec["output_dir"]) / "metrics.jsonl") if "event" not in r and "loss" in r]
    seconds = [r["tokens"] / r["tokens_per_second"] for r in steps[spec["warmup"]:] if r.get("tokens_per_second")]
    summary = result.summary
    return {"fits": True,
            "samples_per_second": DNALLM["batch_size"] / median(seconds) if seconds else None,
            "tracked_peak_bytes": summary.get("tracked_peak_bytes"), "rss_peak_bytes": _peak_rss(),
            "padding_tokens": sum(r.get("padding_tokens", 0) for r in steps),
            "ran": f"micro-batch {summary.get('micro_batch_size')}, checkpointing {summary.get('gradient_checkpointing')},"
                   f" loss chunk {summary.get('loss_chunk_size')}, OOM recovered {summary.get('oom_events') or 0}x"}


def _rate(stamps: list[float], warmup: int) -> float | None:
    durations = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][warmup:]
    return DNALLM["batch_size"] / median(durations) if durations else None


WORKERS = {"hf": hf_worker, "memfit": memfit_worker}


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, shape: dict[str, Any], workdir: Path):
        self.args, self.shape, self.workdir = args, shape, workdir
        self.model_dir = workdir / "model"
        self.count = 0
        self.longest_ran: dict[str, str] = {}

    def run(self, kind: str, **spec: Any) -> dict[str, Any]:
        self.count += 1
        spec = {"kind": kind, "name": f"{kind}-{self.count}", "model_dir": str(self.model_dir),
                "output_dir": str(self.workdir / f"run-{self.count}"), "warmup": self.shape["warmup"],
                "mode": self.args.memfit_mode, **spec}
        if self.args.quick:  # in this process: seconds, not a fresh interpreter per run
            return WORKERS[kind](spec)
        return run_worker(__file__, spec, timeout=1800)

    def throughput(self) -> dict[str, dict[str, Any]]:
        data = write_rows(self.workdir / "train.csv", self.shape["rows"], self.shape["min_length"],
                          self.shape["max_length"])
        common = {"data": str(data), "max_length": self.shape["max_length"]}
        results = {}
        for kind in ("hf", "memfit"):
            # The tracker's per-operator cost stays out of the timed run (quick: one tracked run does both).
            timed = self.run(kind, steps=self.shape["steps"], track=not self.shape["tracked_run"], **common)
            tracked = self.run(kind, steps=2, track=True, **common) if self.shape["tracked_run"] else timed
            results[kind] = {**timed, "tracked_peak_bytes": tracked["tracked_peak_bytes"]}
        return results

    def fits(self, kind: str, length: int, cap: int | None) -> dict[str, Any]:
        data = write_rows(self.workdir / f"fixed-{length}.csv", 2 * DNALLM["batch_size"], 0, 0, fixed=length - 2)
        return self.run(kind, data=str(data), max_length=length, steps=self.shape["fit_steps"], cap=cap,
                        track=cap is None, warmup=0)

    def _fits(self, kind: str, length: int, cap: int) -> bool:
        result = self.fits(kind, length, cap)
        if result["fits"]:
            self.longest_ran[kind] = f"{length} tokens: {result.get('ran')}"
        return bool(result["fits"])

    def trainer_peak_at(self, length: int) -> int:
        """The Trainer's tracked peak with every row `length` tokens: the default cap (it fits `length` exactly)."""
        return int(self.fits("hf", length, None)["tracked_peak_bytes"])

    def longest(self, kind: str, cap: int, known_fit: int = 0) -> tuple[int, list[tuple[int, bool]]]:
        """The longest length (tokens) that fits: doubling from fit_start (or past `known_fit`, a length already seen
        to fit), then bisecting between the last fit and the first failure."""
        tried: list[tuple[int, bool]] = []
        fit, fail = known_fit, None
        length = 2 * known_fit if known_fit else self.shape["fit_start"]
        while length <= self.shape["fit_max"]:
            ok = self._fits(kind, length, cap)
            tried.append((length, ok))
            if not ok:
                fail = length
                break
            fit, length = length, 2 * length
        for _ in range(self.shape["bisections"]):
            if fail is None or fit == 0:
                break
            middle = (fit + fail) // 2
            ok = self._fits(kind, middle, cap)
            tried.append((middle, ok))
            fit, fail = (middle, fail) if ok else (fit, middle)
        return fit, tried


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes in this process (the smoke test)")
    parser.add_argument("--cap", help="memory cap of the longest-sequence search (default: the Trainer's tracked peak"
                        " with every row as long as the first length tried, so that the Trainer fits that length)")
    parser.add_argument("--memfit-mode", choices=("recovery", "plan"), default="recovery",
                        help="memfit under the cap: its OOM recovery and escalation (default), or the planner's choice")
    parser.add_argument("--out", help="markdown file to write the section into (e.g. docs/benchmarks.md)")
    parser.add_argument("--json", help="also write the raw results to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        emit_result(WORKERS[spec["kind"]](spec))
        return 0
    from memfit.units import format_bytes, parse_size

    shape = dict(QUICK if args.quick else FULL)
    load = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memfit-dnallm-") as tmp:
        bench = Bench(args, shape, Path(tmp))
        save_model(bench.model_dir, shape)
        speed = bench.throughput()
        cap = parse_size(args.cap) if args.cap else bench.trainer_peak_at(shape["fit_start"])
        hf_longest, hf_tried = bench.longest("hf", cap, known_fit=0 if args.cap else shape["fit_start"])
        memfit_longest, memfit_tried = bench.longest("memfit", cap)
    hf, mf = speed["hf"], speed["memfit"]
    ratios = {
        "samples_per_second": mf["samples_per_second"] / hf["samples_per_second"],
        "tracked_peak": mf["tracked_peak_bytes"] / hf["tracked_peak_bytes"],
        "rss_peak": mf["rss_peak_bytes"] / hf["rss_peak_bytes"],
        "longest_sequence": memfit_longest / hf_longest if hf_longest else float("inf"),
    }
    rows = [
        ["samples/s", f"{hf['samples_per_second']:.2f}", f"{mf['samples_per_second']:.2f}",
         f"{ratios['samples_per_second']:.2f}x"],
        ["tracked peak (live tensors)", format_bytes(hf["tracked_peak_bytes"]), format_bytes(mf["tracked_peak_bytes"]),
         f"{ratios['tracked_peak']:.2f}x"],
        ["process peak RSS", format_bytes(hf["rss_peak_bytes"]), format_bytes(mf["rss_peak_bytes"]),
         f"{ratios['rss_peak']:.2f}x"],
        [f"longest sequence under a {format_bytes(cap)} cap (tokens)", str(hf_longest), str(memfit_longest),
         f"{ratios['longest_sequence']:.2f}x"],
    ]
    table = markdown_table(["", "Trainer as DNALLM sets it up", "memfit", "memfit / Trainer"], rows)
    tried = (f"Lengths tried (tokens, fits): Trainer {hf_tried}; memfit {memfit_tried}. memfit at its longest ran"
             f" {bench.longest_ran.get('memfit')}; in the throughput run {mf.get('ran')}, {mf.get('padding_tokens')}"
             f" padding tokens (the Trainer pads every row to max_length).")
    shape_line = (f"ESM-like encoder, hidden {shape['hidden']}, {shape['layers']} layers, rotary; {shape['rows']} rows of"
                  f" {shape['min_length']}-{shape['max_length'] - 2} bases (log-uniform), max_length {shape['max_length']};"
                  f" {shape['steps']} steps, median after {shape['warmup']}.")
    print(table)
    print(shape_line)
    print(tried)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.0f} s; load before {load[0]:.2f})")
    raw = {"shape": shape, "cap_bytes": cap, "throughput": speed, "ratios": ratios,
           "longest": {"hf": hf_longest, "memfit": memfit_longest, "hf_tried": hf_tried, "memfit_tried": memfit_tried}}
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    if args.out:
        command = "python benchmarks/bench_dnallm.py" + (" --quick" if args.quick else "") + f" --out {args.out}"
        body = (f"`{command}` on {machine_description()} ({today()}, load average {load[0]:.2f} before the run,"
                f" {elapsed / 60:.0f} minutes).\n\n{shape_line}\n\n{table}\n\n{tried}\n")
        write_section(args.out, "DNALLM's Trainer against memfit (DNA sequence classification)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

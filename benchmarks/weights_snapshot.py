"""The final weights of fixed-seed `memfit train` runs, one sha256 a tensor, saved and compared.

A refactoring of how a run is set up and stepped must not change what it trains. This script runs the command
line (`python -m memfit train`, each run in a subprocess of its own) on tiny models for a few optimizer steps
with a fixed seed, over a grid that covers the techniques: plain training, gradient checkpointing (full and
selective), chunked loss, tiled MLP, LoRA, QLoRA, the optimizer step in backward, activation offload, packed
conversations, gradient accumulation, bf16 autocast, an encoder classifier, a mixture of experts with LoRA and
8-bit AdamW. For each run it records a sha256 of every tensor of the final model (or adapter) that the run
writes, the last loss of metrics.jsonl and what the run says ran (precision, optimizer, attention,
checkpointing, loss chunk), in one JSON file. With `--compare OLD.json` it lists every configuration, tensor,
loss and setting that differs from the earlier snapshot, and exits 1 when any does.

    python benchmarks/weights_snapshot.py --src /tmp/before/src --out before.json   # another checkout's src/
    python benchmarks/weights_snapshot.py --out after.json --compare before.json     # this checkout's src/

`--src PATH` runs the command line from that source tree (PYTHONPATH=PATH, ahead of the installed memfit);
without it, from this checkout's src/. The tiny models are built here, from configs with a fixed seed, by
transformers alone (nothing is downloaded, and nothing of the tree under test shapes them), and the hashes of
their initial weights are saved too, so that a changed starting point is told apart from a changed run.

Every run is bitwise reproducible on one machine: each is a fresh process with one intra-op thread
(OMP_NUM_THREADS=1, so no reduction is split by how many cores happen to be free), and the data order and the
initialisation of new weights (LoRA, the classifier head) come from --seed. Hashes are exact, so snapshots
compare only between runs on the same machine with the same torch, transformers and bitsandbytes (a CPU with
other kernels rounds differently). About a minute on 2 idle CPU cores, up to three on busy ones (`--jobs 2`,
the default: two runs at once, which changes no bit).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# The flags every run shares: a few steps of short samples; no report, memory tracking or disk check (they read
# or write around the training, never its numbers, and cost time).
COMMON = "--max-steps 4 --seq-len 64 --batch-size 2 --seed 0 --lr 1e-2 --no-report --no-disk-check --no-track-memory"
# Each entry: a name, the model (a fixture built below) and the flags after the common ones. The learning rate is
# high so that four steps move every weight well past rounding: a path that changed the update shows in the hashes.
RUNS: list[tuple[str, str, str]] = [
    ("plain", "llama", ""),
    ("checkpointing full", "llama", "--gradient-checkpointing full"),
    ("checkpointing selective", "llama", "--gradient-checkpointing selective"),
    ("loss chunk", "llama", "--loss-chunk-size 32"),
    ("tiled mlp", "llama", "--tiled-mlp 4"),
    ("lora", "llama", "--lora-r 4 --lora-targets all-linear"),
    ("qlora", "llama", "--lora-r 4 --quantize 4bit"),
    ("optimizer in backward", "llama", "--optimizer-in-backward"),
    ("activation offload", "llama", "--gradient-checkpointing full --activation-offload"),
    ("packing chat", "llama", "--dataset builtin:chat --packing samples --seq-len 256 --truncate --lora-r 4"),
    ("accumulation", "llama", "--batch-size 1 --gradient-accumulation-steps 3"),
    ("bf16 autocast", "llama", "--precision bf16 --gradient-checkpointing selective"),
    ("adamw-8bit", "llama", "--optimizer adamw-8bit"),
    ("encoder classification", "bert", "--task sequence-classification --dataset {dna_csv} --num-labels 3"),
    ("moe lora", "moe", "--lora-r 4"),
]
# What the run summary says ran: a silent fallback (bitsandbytes missing, checkpointing off) shows as a change.
RAN = ("precision", "optimizer", "attention", "gradient_checkpointing", "loss_chunk_size", "steps",
       "effective_batch_size", "seq_len", "packing", "lora", "experts", "tiled_experts", "fallbacks")


@dataclass
class Fixtures:
    """The saved tiny models (name -> directory) and the data files of a snapshot."""

    models: dict[str, Path]
    dna_csv: Path


# ---------------------------------------------------------------------------
# Fixtures: tiny models and data, built from configs with a fixed seed
# ---------------------------------------------------------------------------


def fixture_paths(root: Path) -> Fixtures:
    return Fixtures({name: root / name for name in ("llama", "moe", "bert")}, root / "dna.csv")


def make_fixtures(root: Path, env: dict[str, str]) -> Fixtures:
    """Build the fixtures under `root` in a subprocess (this script with --build-fixtures): the parent stays free
    of transformers' import-time warnings, and prints the builder's output only when it fails."""
    completed = subprocess.run([sys.executable, __file__, "--build-fixtures", str(root)], capture_output=True,
                               text=True, env=env, timeout=600)
    if completed.returncode != 0:
        tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"building the tiny models failed (exit {completed.returncode}):\n{tail}")
    return fixture_paths(root)


def build_fixtures(root: Path) -> None:
    """Save the tiny models (Llama, a BERT encoder with a DNA tokenizer, a Mixtral-shaped mixture of experts).

    The decoders are saved without a tokenizer: their runs pass `--tokenizer tiny` (memfit's byte tokenizer,
    257 tokens), so the vocabulary is 257.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shared = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                  bos_token_id=256, eos_token_id=256, pad_token_id=256, tie_word_embeddings=False)
    configs = {
        "llama": AutoConfig.for_model("llama", **shared),
        # 4 experts, 2 a token: memfit's fused expert stacks, their LoRA and the router all train.
        "moe": AutoConfig.for_model("mixtral", **shared, num_local_experts=4, num_experts_per_tok=2),
    }
    paths = fixture_paths(root)
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(paths.models[name])
    torch.manual_seed(0)
    # No dropout: the encoder's run then draws no random numbers beyond its new classifier head's initialisation.
    bert = BertForMaskedLM(BertConfig(
        vocab_size=len(DNA_VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0))
    bert.save_pretrained(paths.models["bert"])
    dna_tokenizer().save_pretrained(paths.models["bert"])
    write_dna_csv(paths.dna_csv, 48)


DNA_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "A", "C", "G", "T", "N"]


def dna_tokenizer():
    """One token a base, [CLS] ... [SEP] around each sequence, as BERT-style DNA models read them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(DNA_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def write_dna_csv(path: Path, rows: int) -> Path:
    """Sequences of 8 to 40 bases in three classes (which base dominates), from a fixed seed."""
    rng = random.Random(0)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sequence", "label"])
        for i in range(rows):
            favoured = "ACG"[i % 3]
            length = rng.randint(8, 40)
            sequence = "".join(favoured if rng.random() < 0.5 else rng.choice("ACGT") for _ in range(length))
            writer.writerow([sequence, ["low", "mid", "high"][i % 3]])
    return path


# ---------------------------------------------------------------------------
# One run and its hashes
# ---------------------------------------------------------------------------


def tensor_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every tensor in the safetensors files under `directory`, keyed 'file:tensor'.

    The digest covers the dtype and shape as well as the bytes, so a cast or a reshape counts as a change.
    """
    import torch
    from safetensors.torch import load_file

    hashes = {}
    for path in sorted(directory.rglob("*.safetensors")):
        for name, tensor in sorted(load_file(path).items()):
            digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            hashes[f"{path.relative_to(directory)}:{name}"] = digest.hexdigest()
    return hashes


def train_command(model: str, flags: str, fixtures: Fixtures, output: Path) -> list[str]:
    arguments = ["train", "--model", str(fixtures.models[model]), "--output-dir", str(output), *COMMON.split(),
                 *flags.format(dna_csv=fixtures.dna_csv).split()]
    if model != "bert":
        arguments += ["--tokenizer", "tiny"]
    return [sys.executable, "-m", "memfit", *arguments]


def run_one(name: str, model: str, flags: str, fixtures: Fixtures, workdir: Path, env: dict[str, str]) -> dict:
    """`memfit train` of one configuration in a subprocess: the hashes of its final weights, its last loss."""
    output = workdir / name.replace(" ", "-")
    command = train_command(model, flags, fixtures, output)
    started = time.monotonic()
    # The working directory is the temporary one, so that nothing a run might write lands in the checkout.
    completed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir, timeout=600)
    seconds = time.monotonic() - started
    entry: dict[str, Any] = {"flags": f"--model {model} {flags}".strip(), "seconds": round(seconds, 1)}
    if completed.returncode != 0:
        lines = (completed.stderr.strip() or completed.stdout.strip()).splitlines()
        # The temporary directory's name changes every snapshot: left out, the same error reads the same.
        entry.update(exit_code=completed.returncode, error=(lines[-1] if lines else "").replace(str(workdir), "<tmp>"))
        return entry
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [record for record in records if "loss" in record and "event" not in record]
    summary = next((record for record in records if record.get("event") == "summary"), {})
    entry["last_loss"] = repr(steps[-1]["loss"]) if steps else None  # repr: every bit of the float, as text
    entry["ran"] = {key: summary.get(key) for key in RAN}
    entry["tensors"] = tensor_hashes(output / "final")
    return entry


def snapshot(source: Path, jobs: int, only: set[str] | None) -> dict[str, Any]:
    chosen = [run for run in RUNS if only is None or run[0] in only]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")])),
           # One intra-op thread: a reduction's order then never depends on the cores free at the time.
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           # Nothing may be downloaded; the models are local directories and the tokenizers built in.
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="memfit-weights-") as temporary:
        workdir = Path(temporary)
        env["MEMFIT_CACHE_DIR"] = str(workdir / "memfit-cache")  # memfit's own caches: none shared with other runs
        fixtures = make_fixtures(workdir / "fixtures", env)
        answers: dict[str, Any] = {
            "fixtures": {name: tensor_hashes(path) for name, path in sorted(fixtures.models.items())},
            "runs": {},
        }

        def one(run: tuple[str, str, str]) -> tuple[str, dict]:
            entry = run_one(*run, fixtures, workdir, env)
            state = f"exit {entry['exit_code']}: {entry['error']}" if "exit_code" in entry else \
                f"{len(entry['tensors'])} tensors, last loss {float(entry['last_loss'] or 'nan'):.6f}"
            print(f"snapshot: {run[0]}: {state} ({entry['seconds']:.1f} s)", file=sys.stderr, flush=True)
            return run[0], entry

        # Runs are independent processes with one thread each: two at a time fill two cores without changing a bit.
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for name, entry in pool.map(one, chosen):
                answers["runs"][name] = entry
    return answers


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every fixture tensor, configuration, tensor, loss and setting that differs, one line each.

    Run times are left out: they say how busy the machine was, not what was trained.
    """
    found = []
    for name in sorted(set(old.get("fixtures", {})) | set(new.get("fixtures", {}))):
        before, after = old.get("fixtures", {}).get(name, {}), new.get("fixtures", {}).get(name, {})
        changed = sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key))
        if changed:
            found.append(f"fixture {name}: {len(changed)} initial tensors differ (the comparison below is void):"
                         f" {', '.join(changed[:5])}")
    old_runs, new_runs = old.get("runs", {}), new.get("runs", {})
    for name in sorted(set(old_runs) | set(new_runs)):
        if name not in old_runs or name not in new_runs:
            found.append(f"{name}: {'absent' if name not in old_runs else 'present'} -> "
                         f"{'absent' if name not in new_runs else 'present'}")
            continue
        before, after = old_runs[name], new_runs[name]
        for key in ("exit_code", "error", "last_loss"):
            if before.get(key) != after.get(key):
                found.append(f"{name}: {key} {before.get(key)!r} -> {after.get(key)!r}")
        if "exit_code" in before or "exit_code" in after:
            continue  # a failed run wrote no weights: its exit code and error, above, are the difference
        ran_before, ran_after = before.get("ran", {}), after.get("ran", {})
        for key in sorted(set(ran_before) | set(ran_after)):
            if ran_before.get(key) != ran_after.get(key):
                found.append(f"{name}: ran.{key} {ran_before.get(key)!r} -> {ran_after.get(key)!r}")
        tensors_before, tensors_after = before.get("tensors", {}), after.get("tensors", {})
        for key in sorted(set(tensors_before) | set(tensors_after)):
            if key not in tensors_before or key not in tensors_after:
                found.append(f"{name}: tensor {key} {'absent' if key not in tensors_before else 'present'} -> "
                             f"{'absent' if key not in tensors_after else 'present'}")
            elif tensors_before[key] != tensors_after[key]:
                found.append(f"{name}: tensor {key} differs")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to write this snapshot (JSON); required")
    parser.add_argument("--compare", type=Path, help="an earlier snapshot: list every difference, exit 1 if any")
    parser.add_argument("--src", type=Path, default=REPO / "src",
                        help="the source tree whose memfit runs (default: this checkout's src/)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument("--only", help="comma-separated configurations (default all): "
                                       + ", ".join(run[0] for run in RUNS))
    parser.add_argument("--build-fixtures", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.build_fixtures:
        build_fixtures(options.build_fixtures)
        return 0
    if options.out is None:
        parser.error("--out is required")
    if not (options.src / "memfit" / "__init__.py").is_file():
        parser.error(f"--src {options.src}: no memfit package there")
    only = {name.strip() for name in options.only.split(",")} if options.only else None
    if only and only - {run[0] for run in RUNS}:
        parser.error(f"--only: unknown configurations {sorted(only - {run[0] for run in RUNS})}")
    started = time.monotonic()
    answers = {"src": str(options.src.resolve()), **snapshot(options.src.resolve(), options.jobs, only)}
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(answers, indent=1, sort_keys=True))
    failed = [name for name, entry in answers["runs"].items() if "exit_code" in entry]
    print(f"snapshot: {len(answers['runs'])} configurations in {time.monotonic() - started:.0f} s,"
          f" {len(failed)} failed (kept as answers): {failed}", file=sys.stderr)
    if not options.compare:
        return 0
    old = json.loads(options.compare.read_text())
    if only:  # configurations left out of this snapshot on purpose are not differences
        old["runs"] = {name: entry for name, entry in old.get("runs", {}).items() if name in only}
    found = differences(old, answers)
    for line in found:
        print(line)
    print(f"snapshot: {len(found)} differences against {options.compare}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

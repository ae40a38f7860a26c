"""Fixtures of the distributed tests: the run arguments, the single-process references, the shared launches.

Starting two ranks (interpreters importing torch and transformers, a process group) costs
more than a 3-step run of the tiny model, so the runs of test_exactness.py and
test_torchrun.py share one launch: the DDP and FSDP2 runs, the DeepSpeed runs, then the runs
that need an earlier run's output (OOM recovery calibrated on a tracked run, resuming a
checkpoint), which the worker starts once those runs are done on every rank. Each run keeps its own flags and
output directory. The
launches also carry a tiny BERT-like sequence classifier's runs, and its regression, token classification and
masked-LM runs with a tiny ESM's sequence classifier (encoder_tasks.py; test_encoder_torchrun.py), the runs of
test_adamw4bit_fsdp.py (adamw4bit_runs.py), and last the engine matrix's cells (engine_matrix.py; its one-process
cells in the references' process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from adamw4bit_runs import adamw4bit_runs, torchao_available
from encoder_tasks import encoder_task_args, encoder_task_runs
from engine_matrix import ENGINES as MATRIX_ENGINES
from engine_matrix import matrix_cells, matrix_runs
from torchrun_helpers import checkpoint_copy, deepspeed_available, run_many

from fault_injection import SGD_FLAGS
from memfit.distributed.parallel import CAP_RANK_ENV
from model_zoo import save_family
from tiny_encoders import dna_rows, save_encoder, write_csv

FAULT = 0.5  # gradients half their size: the loss normalizer not divided by the world size


@pytest.fixture(scope="session")
def run_args(llama_dir, text_file) -> list[str]:
    """A 3-step run with a global batch of 8 samples of 64 tokens."""
    return [
        "--model",
        str(llama_dir),
        "--dataset",
        str(text_file),
        "--seq-len",
        "64",
        "--max-steps",
        "3",
        "--loss-chunk-size",
        "0",
        "--no-report",
    ]


@pytest.fixture(scope="session")
def sgd_args(run_args) -> list[str]:
    """The same run under plain SGD without clipping: the final weights are the gradients' sum."""
    return [*run_args, *SGD_FLAGS, "--lr", "0.5"]


@pytest.fixture(scope="session")
def reshard_args(sgd_args) -> list[str]:
    """The runs of test_reshard_resume.py: SGD, 4 steps, a checkpoint every 2."""
    return [*sgd_args, "--max-steps", "4", "--save-every", "2", "--batch-size", "4"]


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory) -> Path:
    """The tiny BERT-like encoder (2 layers, hidden 32) with the DNA tokenizer that tests/unit/tasks trains."""
    return save_encoder(tmp_path_factory.mktemp("encoder") / "bert", "bert")


@pytest.fixture(scope="session")
def encoder_sgd_args(bert_dir, tmp_path_factory) -> list[str]:
    """3 SGD steps of sequence classification on 24 DNA rows of 8 to 40 bases: a global batch of 8 rows, each
    micro-batch padded to its own longest row, so only a per-sample loss over the global batch is exact."""
    table = write_csv(tmp_path_factory.mktemp("dna") / "train.csv", dna_rows(24))
    return ["--model", str(bert_dir), "--dataset", str(table), "--task", "sequence-classification", "--seq-len", "64",
            "--max-steps", "3", "--no-report", *SGD_FLAGS, "--lr", "0.5"]


@pytest.fixture(scope="session")
def esm_dir(tmp_path_factory) -> Path:
    """The tiny ESM-like encoder (2 layers, hidden 32, rotary positions) with the DNA tokenizer."""
    return save_encoder(tmp_path_factory.mktemp("encoder") / "esm", "esm")


@pytest.fixture(scope="session")
def encoder_tasks_args(bert_dir, esm_dir, tmp_path_factory) -> dict[str, list[str]]:
    """The other encoder runs (encoder_tasks.py): regression, token classification, masked LM on the tiny BERT,
    sequence classification on the tiny ESM, over the same kind of table as encoder_sgd_args."""
    table = write_csv(tmp_path_factory.mktemp("dna-tasks") / "train.csv", dna_rows(24))
    return encoder_task_args({"bert": bert_dir, "esm": esm_dir}, table)


@pytest.fixture(scope="session")
def moe_sgd_args(text_file, tmp_path_factory) -> list[str]:
    """3 SGD steps of the tiny Qwen3-MoE (tests/model_zoo.py: 4 fused experts a layer, top-2, balancing loss off):
    FSDP2 shards its 3-D expert parameters over the ranks like every other parameter."""
    directory = save_family("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")
    return ["--model", str(directory), "--dataset", str(text_file), "--seq-len", "32", "--max-steps", "3",
            "--loss-chunk-size", "0", "--no-report", *SGD_FLAGS, "--lr", "0.5"]


@pytest.fixture(scope="session")
def references(run_args, sgd_args, reshard_args, encoder_sgd_args, encoder_tasks_args, moe_sgd_args, llama_dir,
               text_file, tmp_path_factory) -> dict[str, Path]:
    """The references, all in one plain process: micro-batch 4 x 2 accumulation, AdamW and SGD; reshard-one,
    the one-process run that test_reshard_resume.py resumes on 2 ranks (in later_runs); encoder-sgd, the
    sequence classifier under SGD; encoder-KEY-sgd, the other encoder tasks (encoder_tasks.py); moe-sgd, the tiny
    Qwen3-MoE under SGD; "matrix": the engine matrix's one-process cells (engine_matrix.matrix_cells), run last."""
    root = tmp_path_factory.mktemp("single")
    named = (("adamw", run_args), ("sgd", sgd_args), ("reshard-one", reshard_args), ("encoder-sgd", encoder_sgd_args),
             *((f"encoder-{key}-sgd", args) for key, args in encoder_tasks_args.items()), ("moe-sgd", moe_sgd_args))
    runs = [{"name": name, "args": [*args, "--batch-size", "4", "--gradient-accumulation-steps", "2",
                                     "--output-dir", str(root / name)]}
            for name, args in named]
    run_many([*runs, *matrix_runs(["none"], llama_dir, text_file, root)], root, nproc=1)
    return {**{name: root / name for name, _ in named}, "matrix": matrix_cells(["none"], root)}


@pytest.fixture(scope="session")
def single_run(references) -> Path:
    """The AdamW reference (default clipping at 1.0)."""
    return references["adamw"]


@pytest.fixture(scope="session")
def sgd_single(references) -> Path:
    """The SGD reference."""
    return references["sgd"]


ENGINES = {"ddp": ["--sharding", "ddp"], "fsdp": ["--sharding", "fsdp"]}


def _engine_runs(run_args, sgd_args, reshard_args, encoder_sgd_args, encoder_tasks_args, moe_sgd_args) -> list[dict]:
    """Per engine an SGD run and its twin with the fault; the AdamW runs of test_torchrun.py; reshard-two, the
    2-rank run that test_reshard_resume.py resumes in one process; encoder-fsdp and its twin, the sequence classifier
    under FSDP2; encoder-KEY-fsdp and their twins, the other encoder tasks; moe-fsdp (memory tracked) and its twin,
    the tiny Qwen3-MoE with its experts sharded."""
    runs = []
    for engine, flags in ENGINES.items():
        for scale in (None, FAULT):
            name = engine if scale is None else f"{engine}-fault"
            tracking = ["--track-memory"] if engine == "ddp" and scale is None else []  # calibrates the cap below
            runs.append({"name": name, "args": [*sgd_args, "--batch-size", "4", *flags, *tracking], "grad_scale": scale})
    at = run_args.index("--loss-chunk-size") + 1
    chunked = [*run_args[:at], "16", *run_args[at + 1 :]]
    runs += [
        {"name": "adamw-fsdp", "args": [*run_args, "--batch-size", "4", "--sharding", "fsdp", "--save-every", "2"]},
        {"name": "adamw-ddp", "args": [*run_args, "--batch-size", "4", "--sharding", "ddp", "--track-memory"]},
        {"name": "adamw-fsdp-chunked", "args": [*chunked, "--batch-size", "4", "--sharding", "fsdp"]},
        {"name": "reshard-two", "args": [*reshard_args, "--sharding", "fsdp"]},
    ]
    runs += [{"name": "encoder-fsdp" if scale is None else "encoder-fsdp-fault", "grad_scale": scale,
              "args": [*encoder_sgd_args, "--batch-size", "4", "--sharding", "fsdp"]} for scale in (None, FAULT)]
    runs += encoder_task_runs(encoder_tasks_args, "fsdp", ["--batch-size", "4", "--sharding", "fsdp"], FAULT)
    runs += [{"name": "moe-fsdp" if scale is None else "moe-fsdp-fault", "grad_scale": scale,
              "args": [*moe_sgd_args, "--batch-size", "4", "--sharding", "fsdp",
                       *(["--track-memory"] if scale is None else [])]} for scale in (None, FAULT)]
    return runs


def _zero_runs(run_args, sgd_args, encoder_sgd_args, encoder_tasks_args, root: Path) -> list[dict]:
    """ZeRO-2 and ZeRO-3 + CPU offload under SGD, each with its faulty twin; then under AdamW; encoder-zero2 and its
    twin, the sequence classifier under ZeRO-2; encoder-KEY-zero2, the other encoder tasks (their twins run under
    FSDP2).

    The ZeRO-2 pair also compiles its blocks (--compile): DeepSpeed's engine around compiled blocks
    must still give the single-process update.
    """
    zero = {"zero2": ["--zero-stage", "2", "--compile"], "zero3-offload": ["--zero-stage", "3", "--zero-offload"]}
    runs = []
    for name, flags in zero.items():
        for scale in (None, FAULT):
            runs.append({"name": name if scale is None else f"{name}-fault", "grad_scale": scale,
                         "args": [*sgd_args, "--batch-size", "2", "--gradient-accumulation-steps", "2", *flags]})
    runs += [{"name": "encoder-zero2" if scale is None else "encoder-zero2-fault", "grad_scale": scale,
              "args": [*encoder_sgd_args, "--batch-size", "2", "--gradient-accumulation-steps", "2",
                       "--zero-stage", "2"]} for scale in (None, FAULT)]
    runs += encoder_task_runs(encoder_tasks_args, "zero2",
                              ["--batch-size", "2", "--gradient-accumulation-steps", "2", "--zero-stage", "2"])
    ds_file = root / "ds.json"
    ds_file.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }))
    runs += [
        {"name": "adamw-zero2-file",
         "args": [*run_args, "--batch-size", "2", "--gradient-accumulation-steps", "2", "--deepspeed", str(ds_file)]},
        {"name": "adamw-zero3-offload", "args": [*run_args, "--batch-size", "4", "--zero-stage", "3", "--zero-offload"]},
    ]
    return runs


def _later_runs(references, run_args, sgd_args, reshard_args, root: Path) -> list[dict]:
    """The runs that read the engine runs' output, with a memory cap on rank 1 only (MEMFIT_MEMORY_CAP_RANK=1).

    capped / capped-fault: SGD under DDP, rank 1 splits its micro-batch of 4 (the fault: gradients 2x), under a cap
    calibrated on the tracked ddp run; adamw-capped: the same under AdamW (calibrated on adamw-ddp);
    adamw-fsdp-resumed: the step-2 checkpoint of adamw-fsdp resumed in a copy of its output directory;
    reshard-one-to-two: the step-2 checkpoint of the one-process reshard-one resumed on 2 FSDP2 ranks (these two
    have no --memory-cap: the cap rank does not apply). The launch's worker copies and calibrates once the runs
    named in "after" are done on every rank (exactness_worker.py).
    """
    one_to_two = checkpoint_copy(references["reshard-one"], root / "reshard-one-to-two", 4)
    runs = [
        {"name": "capped", "args": sgd_args, "after": ["ddp"], "cap_from": str(root / "ddp")},
        {"name": "capped-fault", "args": sgd_args, "grad_scale": 2.0, "after": ["ddp"], "cap_from": str(root / "ddp")},
        {"name": "adamw-capped", "args": run_args, "after": ["adamw-ddp"], "cap_from": str(root / "adamw-ddp")},
    ]
    for run in runs:
        run["args"] = [*run["args"], "--batch-size", "4", "--sharding", "ddp"]
    runs.append({"name": "adamw-fsdp-resumed", "after": ["adamw-fsdp"],
                 "checkpoint_copy": [str(root / "adamw-fsdp"), str(root / "adamw-fsdp-resumed"), 3],
                 "args": [*run_args, "--batch-size", "4", "--sharding", "fsdp", "--resume", "auto"]})
    runs.append({"name": one_to_two.name, "args": [*reshard_args, "--sharding", "fsdp", "--resume", "auto"]})
    for run in runs:
        run["env"] = {CAP_RANK_ENV: "1"}
    return runs


@pytest.fixture(scope="session")
def shared_launch(references, run_args, sgd_args, reshard_args, encoder_sgd_args, encoder_tasks_args, moe_sgd_args,
                  llama_dir, text_file, tmp_path_factory) -> dict:
    """One torchrun launch for the engine runs, the DeepSpeed runs (when deepspeed imports) and the later runs
    that read the engine runs' output: starting the ranks (interpreters, imports, the process group) costs more
    than all their 3-step runs; then the 4-bit AdamW runs (when torchao imports) and last the engine matrix's
    2-rank cells. {"dirs": {NAME: output directory}, "logs": {NAME: rank 0's log}, "zero": bool, "matrix": the
    cells (engine_matrix.matrix_cells)}."""
    root = tmp_path_factory.mktemp("engines")
    zero = deepspeed_available()
    runs = _engine_runs(run_args, sgd_args, reshard_args, encoder_sgd_args, encoder_tasks_args, moe_sgd_args)
    runs += _zero_runs(run_args, sgd_args, encoder_sgd_args, encoder_tasks_args, root) if zero else []
    runs += _later_runs(references, run_args, sgd_args, reshard_args, root)
    for run in runs:
        run["args"] = [*run["args"], "--output-dir", str(root / run["name"])]
    runs += adamw4bit_runs(llama_dir, text_file, root) if torchao_available() else []
    several = [engine for engine, (_, ranks) in MATRIX_ENGINES.items() if ranks == 2 and (zero or engine != "zero2")]
    runs += matrix_runs(several, llama_dir, text_file, root)
    logs = run_many(runs, root, timeout=1800)
    dirs = {run["name"]: Path(run["args"][-1]) for run in runs}
    return {"dirs": dirs, "logs": logs, "zero": zero, "matrix": matrix_cells(several, root)}


@pytest.fixture(scope="session")
def engine_runs(shared_launch) -> dict[str, Path]:
    """The engine runs of the shared launch (_engine_runs): NAME -> output directory."""
    return shared_launch["dirs"]


@pytest.fixture(scope="session")
def later_runs(shared_launch) -> dict:
    """The later runs of the shared launch (_later_runs): NAME -> output directory, and "logs": NAME -> rank 0's log."""
    return {**shared_launch["dirs"], "logs": shared_launch["logs"]}


@pytest.fixture(scope="session")
def zero_runs(shared_launch) -> dict[str, Path]:
    """The DeepSpeed runs of the shared launch (_zero_runs): NAME -> output directory."""
    if not shared_launch["zero"]:
        pytest.skip("deepspeed is not installed (pip install memfit[deepspeed]; make test installs it)")
    return shared_launch["dirs"]

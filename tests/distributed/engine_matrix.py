"""The engine matrix's cells (test_optimizer_engine_matrix.py) as runs of the session's launches.

Every optimizer the CLI accepts under each engine, 2 steps of the tiny Llama. The one-process cells run in the
references' process, the 2-rank cells at the end of the shared torchrun launch (conftest.py), so the matrix pays
no interpreter start, import or process group of its own. A cell may exit 0 (it trained) or 2 (refused up front);
a crash ends the launch's later cells, since the process group may be broken after it (exactness_worker.py).
"""

from __future__ import annotations

from pathlib import Path

from torchrun_helpers import exit_code

from memfit.config import OPTIMIZERS

# (engine flags, ranks)
ENGINES = {
    "none": ([], 1),
    "ddp": (["--sharding", "ddp"], 2),
    "fsdp": (["--sharding", "fsdp"], 2),
    "zero2": (["--zero-stage", "2"], 2),
}


def matrix_args(llama_dir: Path, text_file: Path) -> list[str]:
    return ["--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "32", "--batch-size", "2",
            "--max-steps", "2", "--loss-chunk-size", "0", "--lr", "1e-2", "--no-report"]


def _name(engine: str, optimizer: str) -> str:
    return f"matrix-{engine}-{optimizer}"


def matrix_runs(engines: list[str], llama_dir: Path, text_file: Path, root: Path) -> list[dict]:
    """Every optimizer under each of `engines`, as run_many's runs writing under `root`."""
    return [{"name": _name(engine, optimizer), "exits": [0, 2], "record": True,
             "args": [*matrix_args(llama_dir, text_file), *ENGINES[engine][0], "--optimizer", optimizer,
                      "--output-dir", str(root / _name(engine, optimizer))]}
            for engine in engines for optimizer in OPTIMIZERS]


def matrix_cells(engines: list[str], root: Path) -> dict:
    """{engine: {optimizer: {"exit_code", "stderr", "output_dir"}}} of the cells run under `root`; a cell not run
    (after a crash) is absent, and so is an engine none of whose cells ran."""
    cells: dict[str, dict] = {}
    for engine in engines:
        for optimizer in OPTIMIZERS:
            name = _name(engine, optimizer)
            code = exit_code(root, name)
            if code is not None:
                cells.setdefault(engine, {})[optimizer] = {
                    "exit_code": code, "stderr": (root / f"{name}.rank0.log").read_text(),
                    "output_dir": str(root / name)}
    return cells

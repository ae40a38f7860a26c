"""Launch memfit under torchrun (2 CPU processes, gloo) and read what the runs wrote."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
# DeepSpeed compiles its CPU communication op on first use (about 90 s): build it once, keep it.
# One directory per environment: the build command names the environment's absolute include paths,
# so two checkouts sharing one directory would rebuild the op each time the other had used it.
EXTENSIONS_CACHE = (Path.home() / ".cache" / "memfit" / "torch-extensions"
                    / hashlib.sha1(str(Path(sys.prefix).resolve()).encode()).hexdigest()[:12])


WORKER = Path(__file__).with_name("exactness_worker.py")


def run_many(runs: list[dict], root: Path, nproc: int = 2, env: dict | None = None, timeout: int = 600) -> dict:
    """Several `memfit train` runs in one torchrun launch of `nproc` ranks (or one plain process when 1).

    `runs`: [{"name": NAME, "args": [...], "grad_scale": None | float}] (more keys: exactness_worker.py); returns
    {NAME: rank 0's stderr} for every run started (a crashed "record" run ends the launch's later runs).
    """
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "runs.json"
    spec.write_text(json.dumps([{"grad_scale": None, **run} for run in runs], default=str))
    if nproc == 1:
        command = [sys.executable, str(WORKER), str(spec)]
    else:  # --standalone: torchrun picks a free port
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(WORKER), str(spec)]
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE), **(env or {})}
    if nproc > 1:
        environment["OMP_NUM_THREADS"] = "1"  # one thread per rank on a 2-core machine
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment)
    assert done.returncode == 0, done.stderr[-6000:]
    logs = {run["name"]: root / f"{run['name']}.rank0.log" for run in runs}
    return {name: log.read_text() for name, log in logs.items() if log.is_file()}


def exit_code(root: Path, name: str) -> int | None:
    """The exit code of rank 0's run NAME in the launch under `root` (run_many), or None when it was not run."""
    path = root / f"{name}.rank0.exit"
    return int(path.read_text()) if path.is_file() else None


def checkpoint_copy(source: Path, target: Path, last_step: int) -> Path:
    """What a run killed after its checkpoint before `last_step` leaves: `source` without its final model, its last
    checkpoint and its metrics."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("final", f"step-{last_step}", "metrics.jsonl"))
    return target


def steps_of(out: Path) -> list[dict]:
    from memfit.train.metrics import read_metrics

    return [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]


def state_bytes(rank: dict) -> int:
    return rank["parameters"] + rank["gradients"] + rank["optimizer_states"]


def rank1_split_cap(tracked_run: Path) -> int:
    """A memory cap for rank 1 that fits a micro-batch of 2, not of 4 (from a --track-memory run)."""
    steps = steps_of(tracked_run)
    static = state_bytes(steps[-1]["ranks"][1])
    peak = max(s["ranks"][1]["tracked_peak_bytes"] for s in steps)
    return static + int(0.8 * (peak - static))


def final_weights(output_dir: Path) -> dict:
    return load_file(str(output_dir / "final" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    import torch

    assert set(a) == set(b)
    for name, tensor in a.items():
        torch.testing.assert_close(b[name].float(), tensor.float(), atol=atol, rtol=0, msg=name)


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True

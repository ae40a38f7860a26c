"""Launch memfit under torchrun (2 CPU processes, gloo) and read what the runs wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
# DeepSpeed compiles its CPU communication op on first use (about 90 s): build it once, keep it.
EXTENSIONS_CACHE = Path.home() / ".cache" / "memfit" / "torch-extensions"


def launch(*args: str, nproc: int = 2, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N -m memfit train ARGS` (a free port is picked)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "memfit",
        "train",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE), **(env or {})}
    result = subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def single(*args: str) -> subprocess.CompletedProcess:
    """The same command in one plain process."""
    result = subprocess.run(
        [sys.executable, "-m", "memfit", "train", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE)},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


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

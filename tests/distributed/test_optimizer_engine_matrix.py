"""Every optimizer the CLI accepts under every engine: it trains, or it is refused up front in one line.

Cells: adamw, adamw-8bit, paged-adamw-8bit, adafactor, sgd x one process, --sharding ddp,
--sharding fsdp (2 ranks, gloo), and DeepSpeed ZeRO-2 when deepspeed imports. A cell
trains when the run exits 0 and the final weights moved from the initial ones; a refused
cell exits 2 with exactly one error line, no traceback and no output directory. The cells run in the session's
launches (engine_matrix.py): no interpreter or process group of their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_matrix import ENGINES
from safetensors.torch import load_file
from torchrun_helpers import deepspeed_available

from memfit.config import OPTIMIZERS, SMALL_STATE_OPTIMIZERS
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

# Cells refused up front, with the words their one error line must contain.
REFUSED: dict[tuple[str, str], str] = {
    ("adafactor", "fsdp"): "--optimizer adafactor cannot run under --sharding fsdp",
    # The small-state optimizers need whole weight matrices (projections, per-head moments): refused on FSDP2 and
    # DeepSpeed shards, pointing to DDP. torchao's 4-bit AdamW quantizes each FSDP2 shard and trains there; DeepSpeed
    # would hand it flat partitions of many parameters, and stays refused.
    **{(name, engine): f"--optimizer {name}" for name in SMALL_STATE_OPTIMIZERS for engine in ("fsdp", "zero2")
       if (name, engine) != ("adamw-4bit", "fsdp")},
}


@pytest.fixture(scope="module")
def matrix(references, shared_launch) -> dict:
    """{engine: {optimizer: cell}}: the "none" cells ran in the references' process, the others at the end of the
    shared torchrun launch (engine_matrix.py, conftest.py)."""
    return {**references["matrix"], **shared_launch["matrix"]}


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_optimizer_trains_or_is_refused_in_one_line(engine, llama_dir, matrix):
    if engine.startswith("zero") and not deepspeed_available():
        pytest.skip("deepspeed is not installed")
    initial = load_file(str(llama_dir / "model.safetensors"))
    assert engine in matrix, f"{engine}: not run (a cell of an earlier engine crashed: see its test)"
    results = matrix[engine]
    problems = []
    for optimizer in OPTIMIZERS:
        if optimizer not in results:
            problems.append(f"{optimizer} x {engine}: not run (an earlier cell crashed)")
            continue
        cell = results[optimizer]
        stderr, out = cell["stderr"], Path(cell["output_dir"])
        errors = [line for line in stderr.splitlines() if "error:" in line]
        refused = REFUSED.get((optimizer, engine))
        if refused is not None:
            if not (cell["exit_code"] == 2 and len(errors) == 1 and refused in errors[0] and "Traceback" not in stderr
                    and not out.exists()):
                problems.append(f"{optimizer} x {engine}: expected a one-line refusal, got exit {cell['exit_code']}: {stderr[-600:]}")
            continue
        if cell["exit_code"] != 0 or "Traceback" in stderr:
            problems.append(f"{optimizer} x {engine}: exit {cell['exit_code']}: {stderr[-1500:]}")
            continue
        steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]
        final = load_file(str(out / "final" / "model.safetensors"))
        moved = [name for name, tensor in initial.items() if name in final and not torch.equal(final[name].float(), tensor.float())]
        if len(steps) != 2 or not moved:
            problems.append(f"{optimizer} x {engine}: {len(steps)} steps logged, {len(moved)} tensors updated")
    assert not problems, "\n".join(problems)

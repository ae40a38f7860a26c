"""--context-parallel 2 with memfit's long-context levers on each rank trains as one process on the whole sequence.

Each lever (LoRA, tiled MLP, offloaded checkpoints, linear RoPE scaling, adam-mini, bitsandbytes' 8-bit AdamW) runs
once in one process on the whole rows and once on 2 gloo ranks that split every row. With plain SGD (no momentum, no
clipping) the final weights are the initial ones minus the summed gradients, so equal weights mean equal gradients;
the two optimizers run with a small rate, where their update is insensitive to a gradient's scale but not to its
direction. DeepSpeed ZeRO-2 and ZeRO-3 run on the split side only, against the plain one process. The references
share one launch, the split runs another. A faulty twin (positions restarting at 0 on each
shard, as if every shard were a row of its own) must differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, run_many

from fault_injection import SGD_FLAGS
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

LEVERS = {
    "lora": ["--lora-r", "4", "--lr", "0.5"],
    "tiled-mlp": ["--tiled-mlp", "3", "--lr", "0.5"],
    "offload": ["--activation-offload", "--gradient-checkpointing", "full", "--lr", "0.5"],
    "rope-scale": ["--rope-scale", "2", "--rope-scaling", "linear", "--lr", "0.5"],
    "adam-mini": ["--optimizer", "adam-mini", "--lr", "0.001"],
    "adamw-8bit": ["--optimizer", "adamw-8bit", "--lr", "0.001"],
    "zero2": ["--batch-size", "1", "--effective-batch-size", "2", "--lr", "0.5"],
    "zero3": ["--batch-size", "1", "--effective-batch-size", "2", "--lr", "0.5"],
}
"""Each lever's flags (after the SGD flags, so an optimizer named here replaces SGD)."""

SPLIT_ONLY = {"zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"]}
"""Flags of the split run only: its reference is the plain one process (DeepSpeed's own averaging must not cancel)."""

RAN = {"lora": ("lora", "'rank': 4"), "tiled-mlp": ("techniques", "'mlp_tiles': 3"),
       "offload": ("techniques", "'activation_offload': 'all'"), "rope-scale": ("rope_scaling", "linear x2"),
       "adam-mini": ("optimizer", "adam-mini"), "adamw-8bit": ("optimizer", "adamw-8bit (bitsandbytes)"),
       "zero2": ("optimizer", "deepspeed zero-2 over 2 rank(s)"), "zero3": ("optimizer", "deepspeed zero-3 over 2 rank(s)")}
"""What a run's start record says the lever did (key, text within it): a lever that fell back would pass the weight check unseen."""


def trained_weights(output_dir: Path) -> dict:
    """The final model's weights, or its adapter's under LoRA (the base stays frozen)."""
    final = output_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(final / name))


@pytest.fixture(scope="module")
def lever_runs(llama_dir, text_file, tmp_path_factory) -> dict[str, Path]:
    """{run name: output directory}: "one-LEVER" in one process, "cp-LEVER" on 2 context ranks, and the fault."""
    root = tmp_path_factory.mktemp("context-parallel-levers")
    base = ["--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "48", "--max-steps", "2",
            "--batch-size", "2", "--packing", "off", "--eval-fraction", "0", "--no-report", "--loss-chunk-size", "0",
            *SGD_FLAGS]
    runs = {name: [*base, *flags] for name, flags in LEVERS.items()}
    run_many([{"name": f"one-{name}", "args": [*args, "--output-dir", str(root / f"one-{name}")]}
              for name, args in runs.items()], root / "one", nproc=1)
    split = {**{name: [*args, *SPLIT_ONLY.get(name, []), "--context-parallel", "2"] for name, args in runs.items()},
             "positions-fault": [*runs["rope-scale"], "--context-parallel", "2"]}
    faults = {"positions-fault": "context_parallel_faults:positions_restart_per_shard"}
    run_many([{"name": f"cp-{name}", "args": [*args, "--output-dir", str(root / f"cp-{name}")],
               "fault": faults.get(name)} for name, args in split.items()], root / "cp", nproc=2)
    return {path.name: path for path in root.iterdir() if (path / "final").is_dir()}


@pytest.mark.parametrize("lever", list(LEVERS))
def test_two_context_ranks_with_the_lever_train_as_one_process(lever, lever_runs):
    one, split = (trained_weights(lever_runs[f"{kind}-{lever}"]) for kind in ("one", "cp"))
    assert_same_weights(one, split)
    start = read_metrics(lever_runs[f"cp-{lever}"] / "metrics.jsonl")[0]
    key, text = RAN[lever]
    assert start["techniques"]["context_parallel"] == 2 and text in str(start[key]), start[key]


def test_the_check_fails_when_positions_restart_on_each_shard(lever_runs):
    with pytest.raises(AssertionError):
        assert_same_weights(trained_weights(lever_runs["one-rope-scale"]), trained_weights(lever_runs["cp-positions-fault"]))

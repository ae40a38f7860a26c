"""--context-parallel 2 under torchrun (gloo) trains as one process on the whole sequence, and the checks can fail.

Every run trains with plain SGD (no momentum, no clipping, constant rate), so the final weights
are the initial ones minus the summed gradients: comparing them compares the gradients. The
one-process references and the context-parallel runs each share one launch; the faulty twins
(labels shifted after the split, the token count per rank) must differ.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
from torchrun_helpers import assert_same_weights, checkpoint_copy, final_weights, run_many

from fault_injection import SGD_FLAGS
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

FAULTS = "context_parallel_faults"


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Short conversations of the bundled chat set (loss on the answers only): packed several to a row."""
    lines = (importlib.resources.files("memfit.data") / "chat" / "chat.jsonl").read_text().splitlines()
    path = tmp_path_factory.mktemp("chat") / "short.jsonl"
    path.write_text("\n".join([line for line in lines if len(line) < 260][:16]) + "\n")
    return path


@pytest.fixture(scope="module")
def cp_runs(llama_dir, text_file, chat_file, tmp_path_factory) -> dict[str, Path]:
    """{name: output directory}: one-process references, then the 2-rank runs, in one launch each."""
    root = tmp_path_factory.mktemp("context-parallel")
    base = ["--model", str(llama_dir), "--seq-len", "48", "--max-steps", "3", "--batch-size", "2", "--no-report",
            "--loss-chunk-size", "0", *SGD_FLAGS, "--lr", "0.5"]
    plain = [*base, "--dataset", str(text_file), "--packing", "off", "--eval-fraction", "0.05", "--track-memory"]
    packed = [*base, "--dataset", str(chat_file), "--chat-template", "chatml", "--packing", "samples",
              "--seq-len", "256", "--gradient-checkpointing", "full"]
    chunked = [*plain[:-1], "--loss-chunk-size", "16"]
    longer = ["--max-steps", "4", "--save-every", "2"]
    references = {"plain": plain, "packed": packed, "chunked": chunked, "long": [*plain, *longer]}
    cp = ["--context-parallel", "2"]
    split = {**{name: [*args, *cp] for name, args in references.items()},
             "edge-fault": [*plain, *cp], "count-fault": [*plain, *cp],
             "resumed": [*plain, *longer, *cp, "--resume", "auto"]}  # the one-process step-2 checkpoint
    faults = {"edge-fault": f"{FAULTS}:labels_shifted_after_split", "count-fault": f"{FAULTS}:per_rank_token_count"}
    run_many([{"name": f"one-{name}", "args": [*args, "--output-dir", str(root / f"one-{name}")]}
              for name, args in references.items()], root / "one", nproc=1)
    checkpoint_copy(root / "one-long", root / "cp-resumed", 4)
    logs = run_many([{"name": f"cp-{name}", "args": [*args, "--output-dir", str(root / f"cp-{name}")],
                      "fault": faults.get(name)} for name, args in split.items()], root / "cp", nproc=2)
    assert "resumed from" in logs["cp-resumed"], logs["cp-resumed"][-2000:]
    return {path.name: path for path in root.iterdir() if (path / "final").is_dir()}


@pytest.fixture(scope="module")
def fsdp_2x2(llama_dir, text_file, tmp_path_factory) -> Path:
    """4 ranks as 2 data x 2 context groups under --sharding fsdp: the one-process reference's 2 samples a step."""
    out = tmp_path_factory.mktemp("context-parallel-fsdp") / "cp-fsdp"
    args = ["--model", str(llama_dir), "--seq-len", "48", "--max-steps", "3", "--batch-size", "1", "--no-report",
            "--loss-chunk-size", "0", *SGD_FLAGS, "--lr", "0.5", "--dataset", str(text_file), "--packing", "off",
            "--eval-fraction", "0.05", "--context-parallel", "2", "--sharding", "fsdp", "--output-dir", str(out)]
    run_many([{"name": "cp-fsdp", "args": args}], out.parent, nproc=4)
    return out


@pytest.mark.parametrize("name", ["plain", "packed", "chunked"])
def test_two_context_ranks_train_as_one_process_on_the_whole_sequence(name, cp_runs):
    assert_same_weights(final_weights(cp_runs[f"one-{name}"]), final_weights(cp_runs[f"cp-{name}"]))
    one, cp = (read_metrics(cp_runs[f"{kind}-{name}"] / "metrics.jsonl") for kind in ("one", "cp"))
    steps = [r for r in one if "loss" in r and "event" not in r], [r for r in cp if "loss" in r and "event" not in r]
    assert [r["loss"] for r in steps[1]] == pytest.approx([r["loss"] for r in steps[0]], abs=1e-4)
    evaluations = [[r["eval_loss"] for r in lines if r.get("event") == "eval"] for lines in (one, cp)]
    assert evaluations[1] == pytest.approx(evaluations[0], abs=1e-5) and len(evaluations[0]) == (name != "packed")


@pytest.mark.parametrize("fault", ["edge-fault", "count-fault"])
def test_the_check_fails_on_a_shard_edge_or_token_count_fault(fault, cp_runs):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(cp_runs["one-plain"]), final_weights(cp_runs[f"cp-{fault}"]))


def test_the_run_says_which_implementation_ran(cp_runs):
    start = read_metrics(cp_runs["cp-plain"] / "metrics.jsonl")[0]
    assert "ulysses (memfit's all-to-all over gloo) across 2 ranks" in str(start)


def test_fsdp2_over_two_data_and_two_context_ranks_trains_as_one_process(fsdp_2x2, cp_runs):
    assert_same_weights(final_weights(cp_runs["one-plain"]), final_weights(fsdp_2x2))
    summary = read_metrics(fsdp_2x2 / "metrics.jsonl")[-1]
    assert summary["world_size"] == 4 and summary["effective_batch_size"] == 2


def _activation_bytes(output_dir: Path) -> int:
    """The tracked activation bytes (saved activations, their gradients, recomputed ones, logits) at the peak."""
    breakdown = read_metrics(output_dir / "metrics.jsonl")[-1]["tracked_breakdown"]
    return sum(breakdown[name] for name in ("activations", "recomputed_activations", "activation_gradients", "logits"))


def test_each_context_rank_holds_about_half_the_activations(cp_runs):
    one, split = _activation_bytes(cp_runs["one-plain"]), _activation_bytes(cp_runs["cp-plain"])
    assert split <= 0.55 * one, (split, one)


def test_a_one_process_checkpoint_resumes_on_two_context_ranks(cp_runs):
    """Weights and optimizer state do not depend on the split: the step-2 checkpoint of one process, resumed under
    --context-parallel 2, ends on the uninterrupted run's weights."""
    assert_same_weights(final_weights(cp_runs["one-long"]), final_weights(cp_runs["cp-resumed"]))

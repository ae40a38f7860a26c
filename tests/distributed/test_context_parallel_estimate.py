"""`memfit estimate --context-parallel 2` gives each rank's tracked peak within 5 % (2 gloo ranks, FSDP2; DDP: 2 %).

One torchrun launch trains a tiny Llama on 2 context ranks with memfit's MemoryTracker on, under
FSDP2 and under the default engine (no --sharding: replicated, as with --sharding ddp), each once
without checkpointing and once with full checkpointing (where the all-to-all buffers are a larger
share of the peak); each rank's largest tracked peak over the steps is compared with the
estimate's per-rank figure for the same flags (the DDP runs with both spellings of the engine).
An estimate that forgot to split the sequence (2x the activations), forgot the all-to-all buffers
(FSDP2: 9 % under with checkpointing; DDP: 4.5 % under) or counted them twice (DDP: 5 % over), or
that counted DDP's gradients twice (a flat bucket copy memfit's in-place all-reduce does not make:
14 % over), fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_helpers import run_many

from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

TOLERANCE = {"fsdp": 0.05, "ddp": 0.02}
"""The bar per engine. Under DDP the estimate lands within 0.5 % of the tracked peak and the all-to-all
buffers are 4.8 % of it with checkpointing, so 2 % fails an estimate that forgets them or counts them twice."""
NO_CHECKPOINTING = ["--seq-len", "512", "--gradient-checkpointing", "off"]
FULL_CHECKPOINTING = ["--gradient-checkpointing", "full"]
SETTINGS = {
    "fsdp-no-checkpointing": ["--sharding", "fsdp", *NO_CHECKPOINTING],
    "fsdp-full-checkpointing": ["--sharding", "fsdp", "--seq-len", "1024", *FULL_CHECKPOINTING],
    # no --sharding: the default engine, replicated as with --sharding ddp
    "ddp-no-checkpointing": NO_CHECKPOINTING,
    "ddp-full-checkpointing": ["--seq-len", "1024", *FULL_CHECKPOINTING],
}
ESTIMATE_SPELLINGS = {"fsdp": {"as-run": []}, "ddp": {"as-run": [], "sharding-ddp": ["--sharding", "ddp"]}}
"""Flags each engine's estimate is also asked with, beside the run's own: the default engine is --sharding ddp."""
COMMON = ["--batch-size", "1", "--context-parallel", "2"]


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 128, 4 heads, 2 key-value heads) with positions for 2,048 tokens."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    config = LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=256, pad_token_id=256, bos_token_id=256)
    directory = tmp_path_factory.mktemp("long-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tracked_runs(long_llama, text_file, tmp_path_factory) -> dict[str, Path]:
    """{setting: output directory} of the 2-rank runs, all in one launch."""
    root = tmp_path_factory.mktemp("context-parallel-estimate")
    runs = [{"name": name, "args": ["--model", str(long_llama), "--dataset", str(text_file), "--max-steps", "2",
                                     "--no-report", "--track-memory", *COMMON, *flags,
                                     "--output-dir", str(root / name)]}
            for name, flags in SETTINGS.items()]
    run_many(runs, root, nproc=2)
    return {name: root / name for name in SETTINGS}


def _rank_peaks(output_dir: Path) -> list[int]:
    """Each rank's largest tracked peak over the run's steps."""
    steps = [record for record in read_metrics(output_dir / "metrics.jsonl") if "ranks" in record]
    assert steps, "no step recorded the ranks' tracked bytes"
    ranks = len(steps[0]["ranks"])
    return [max(step["ranks"][rank]["tracked_peak_bytes"] for step in steps) for rank in range(ranks)]


def _estimated_per_rank(model: Path, flags: list[str], capsys) -> dict:
    from memfit.cli.estimate import run

    capsys.readouterr()
    assert run(["--model", str(model), *COMMON, *flags, "--world-size", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("setting,spelling", [pytest.param(setting, flags, id=f"{setting}-{name}") for setting in SETTINGS
                                               for name, flags in ESTIMATE_SPELLINGS[setting.split("-")[0]].items()])
def test_each_rank_peak_is_within_five_percent_of_the_estimate(setting, spelling, tracked_runs, long_llama, capsys):
    estimate = _estimated_per_rank(long_llama, [*SETTINGS[setting], *spelling], capsys)
    split = estimate["details"]["context_parallel"]
    assert split["tokens_per_rank"] * 2 == split["seq_len"] and split["data_parallel"] == 1
    peaks = _rank_peaks(tracked_runs[setting])
    assert len(peaks) == 2
    for rank, peak in enumerate(peaks):
        error = estimate["peak_bytes"] / peak - 1
        assert abs(error) <= TOLERANCE[setting.split("-")[0]], f"rank {rank}: estimated {estimate['peak_bytes']:,} vs tracked {peak:,} ({error:+.1%})"

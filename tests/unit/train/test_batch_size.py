"""find-batch-size: the size it returns trains under the cap, the next one does not, in O(log n) probes."""

from __future__ import annotations

import json
import math

from memfit.config_loading import load_config
from memfit.train.batch_size import Probe, find_batch_size, search_batch_size
from memfit.train.loop import train
from memfit.train.metrics import read_metrics


def test_search_takes_logarithmic_probes():
    for limit in (1, 2, 3, 37, 64, 1000):
        def probe(size, limit=limit):
            return Probe(size, size <= limit, size)

        best, probes = search_batch_size(probe, upper=4096)
        assert best == limit
        assert len(probes) <= 2 * math.ceil(math.log2(limit + 1)) + 2
    best, _ = search_batch_size(lambda size: Probe(size, False, None))
    assert best == 0


def test_found_size_trains_under_the_cap_and_the_next_does_not(llama_dir, text_file, tmp_path):
    cap = 12 * 1000**2
    common = dict(model=str(llama_dir), dataset=str(text_file), seq_len=128, loss_chunk_size=0, memory_cap=cap)
    result = find_batch_size(load_config(overrides=common | {"batch_size": 8, "output_dir": str(tmp_path / "find")}), margin=0.1)
    best = result.max_batch_size
    assert best >= 1
    sizes = {p.batch_size: p for p in result.probes}
    assert sizes[best].fits and sizes[best].peak_bytes <= result.limit_bytes
    assert not sizes[best + 1].fits  # the first failure was probed (bisection ends next to it)
    # Training at the found size under the cap hits no OOM.
    run = train(load_config(overrides=common | {"batch_size": best, "max_steps": 2, "output_dir": str(tmp_path / "train"),
                                                 "track_memory": True}))
    records = read_metrics(run.output_dir / "metrics.jsonl")
    assert not [r for r in records if r.get("event") == "oom"]
    assert run.tracked_peak_bytes <= cap


def test_cli_json_and_auto_batch_size(warm_memfit, llama_dir, text_file, tmp_path):
    # Both commands run in processes forked from the warm server: one import of torch for the two.
    args = ["--model", llama_dir, "--dataset", text_file, "--seq-len", "128", "--memory-cap", "12MB",
            "--effective-batch-size", "8", "--batch-size", "8", "--loss-chunk-size", "0"]
    result = warm_memfit.run("find-batch-size", *args, "--json", "--output-dir", tmp_path / "f")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found) >= {"max_batch_size", "recommended_batch_size", "gradient_accumulation_steps", "peak_bytes_at_recommended", "probes"}
    assert found["recommended_batch_size"] * found["gradient_accumulation_steps"] == 8
    trained = warm_memfit.run("train", *args, "--auto-batch-size", "--max-steps", "2", "--output-dir", tmp_path / "t")
    assert trained.returncode == 0, trained.stderr
    steps = [r for r in read_metrics(tmp_path / "t" / "metrics.jsonl") if "event" not in r]
    assert steps[0]["micro_batch_size"] == found["recommended_batch_size"]
    assert not [r for r in read_metrics(tmp_path / "t" / "metrics.jsonl") if r.get("event") == "oom"]

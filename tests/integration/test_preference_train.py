"""`memfit train --task dpo|simpo|orpo|kto` end to end on a saved tiny Llama, and what stays exact.

Each objective trains a few steps on CPU and writes TRL-named metrics (rewards/*, logps/*) in its step lines and the
reference it ran in its start line. The three references (a frozen copy, the adapters disabled under LoRA, the
log-probabilities cached before training) reach the same weights after SGD steps; a cached file whose key no
longer matches (another model, other data) is recomputed, never read. An out-of-memory error injected in the
backward of a DPO step gives the update (and the step's metrics) of the run that never hit it; recovery that counts
gradients twice does not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import (
    SGD_NO_CLIPPING,
    assert_same_weights,
    freezing_ignored,
    largest_update,
    oom_in_backward_of_linear,
)
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit_cli import run_memfit

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
PROMPTS = ["Hi?", "Name a colour.", "Two and two?", "Say yes.", "Best pet?", "Sky colour?", "Tea or coffee?",
           "Count to three."]
CHOSEN = ["Hello there!", "Blue.", "Four.", "Yes.", "A cat, calm and clean.", "Blue by day.", "Tea, please.",
          "One, two, three."]
REJECTED = ["Go away.", "Loud.", "Five, or maybe six.", "No.", "Rocks.", "Green.", "Neither, ever.", "Seven."]


def write_pairs(path: Path, count: int = 8, shift: int = 0) -> Path:
    """`count` short conversational pairs; another `shift` is other data."""
    records = [{"prompt": [{"role": "user", "content": PROMPTS[(i + shift) % 8]}],
                "chosen": [{"role": "assistant", "content": CHOSEN[(i + shift) % 8]}],
                "rejected": [{"role": "assistant", "content": REJECTED[(i + shift) % 8]}]} for i in range(count)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_line(run_dir: Path) -> dict:
    return next(record for record in records(run_dir) if record.get("event") == "start")


def step_lines(run_dir: Path) -> list[dict]:
    return [record for record in records(run_dir) if record.get("event") is None and "step" in record]


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final model's trained tensors: the whole model, or the LoRA adapter's."""
    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(final / name))


def sgd_config(model_dir, data, out, task: str = "dpo", **extra):
    values = dict(model=str(model_dir), dataset=str(data), chat_template="chatml", task=task, seq_len=96,
                  batch_size=4, max_steps=3, output_dir=str(out), lr=0.1, beta=0.5, report=False,
                  cache_dir=str(Path(out) / "cache"), **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


# ---------------------------------------------------------------- end to end


def test_memfit_train_task_dpo_runs_and_writes_trls_metrics(llama_dir, tmp_path):
    out = tmp_path / "run"
    result = run_memfit("train", "--task", "dpo", "--model", llama_dir, "--dataset", "builtin:preferences",
                        "--chat-template", "chatml", "--max-steps", "3", "--seq-len", "128", "--truncate",
                        "--output-dir", out, "--report", "false")
    assert result.returncode == 0, result.stderr
    assert "memfit: reference: copy" in result.stderr
    task = start_line(out)["task"]
    assert task["name"] == "dpo" and task["loss_per"] == "pair" and task["reference"]["mode"] == "copy"
    assert task["reference"]["copy_bytes"] > 0
    steps = step_lines(out)
    assert len(steps) == 3 and steps[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: policy = reference
    for name in REWARDS:
        assert all(name in step for step in steps), name


@pytest.mark.parametrize("task, extra, reference", [
    ("simpo", {}, "none"), ("orpo", {}, "none"), ("kto", {}, "copy"), ("dpo", {"lora_r": 8}, "adapters-off"),
])
def test_each_objective_trains_end_to_end(llama_dir, pairs, tmp_path, task, extra, reference):
    out = tmp_path / task
    result = train(sgd_config(llama_dir, pairs, out, task, lr=1e-3, optimizer="adamw", eval_fraction=0.25, **extra))
    assert result.steps == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert start_line(out)["task"]["reference"]["mode"] == reference
    evaluation = next(record for record in records(out) if record.get("event") == "eval")
    # KTO logs each side only when the batch has some of it, as TRL does: its KL estimate always
    assert ("eval_kl" in evaluation) if task == "kto" else ("eval_rewards/accuracies" in evaluation)
    steps = step_lines(out)
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins") + (("kl",) if task == "kto" else
                                                                         ("rewards/accuracies",))
    for name in names:
        assert all(name in step for step in steps), name


# ---------------------------------------------------------------- the references agree


def test_copy_and_cached_references_reach_the_same_weights(llama_dir, pairs, tmp_path):
    copy_run = trained_weights(train(sgd_config(llama_dir, pairs, tmp_path / "copy")).output_dir)
    cached = tmp_path / "cached"
    cached_run = trained_weights(train(sgd_config(llama_dir, pairs, cached, reference="cached")).output_dir)
    initial = load_file(str(Path(llama_dir) / "model.safetensors"))
    assert largest_update(initial, copy_run) > 1e-2
    assert_same_weights(copy_run, cached_run, atol=1e-6)
    facts = start_line(cached)["task"]["reference"]
    assert facts["mode"] == "cached" and not facts["reused"] and Path(facts["cache_file"]).is_file()


def test_adapters_off_copy_and_cached_references_reach_the_same_lora_weights(llama_dir, pairs, tmp_path):
    runs = {mode: trained_weights(train(sgd_config(llama_dir, pairs, tmp_path / mode, lora_r=8, reference=mode)
                                        ).output_dir) for mode in ("adapters-off", "copy", "cached")}
    assert start_line(tmp_path / "adapters-off")["task"]["reference"]["mode"] == "adapters-off"
    assert max(tensor.abs().max().item() for name, tensor in runs["adapters-off"].items() if "lora_B" in name) > 1e-3
    assert_same_weights(runs["adapters-off"], runs["copy"], atol=1e-6)
    assert_same_weights(runs["adapters-off"], runs["cached"], atol=1e-6)


def test_a_cached_reference_is_recomputed_when_the_model_or_the_data_change(llama_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    data = write_pairs(tmp_path / "pairs.jsonl")
    cache = tmp_path / "cache"

    def run(name: str) -> dict:
        out = tmp_path / name
        train(sgd_config(model_dir, data, out, reference="cached", cache_dir=str(cache), max_steps=1))
        return start_line(out)["task"]["reference"]

    first = run("first")
    stored = load_file(first["cache_file"])["logps"]
    assert not first["reused"] and run("again")["reused"]
    # the same directory, other weights: the checksum sees it
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.5
    from safetensors.torch import save_file

    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    changed_model = run("changed-model")
    assert not changed_model["reused"] and changed_model["cache_file"] == first["cache_file"]
    assert not torch.allclose(load_file(changed_model["cache_file"])["logps"], stored)
    write_pairs(data, shift=3)  # the same file name, other pairs
    changed_data = run("changed-data")
    assert not changed_data["reused"]


# ---------------------------------------------------------------- out of memory in a DPO step


def _oom_above_one_pair():
    """An OOM when backward reaches layer 0's MLP (hidden 64 -> 128) for micro-batches of more than 2 rows (one pair):
    the later layers hold their gradients by then, so a recovery that counted them twice would show."""
    return oom_in_backward_of_linear(64, 128, above_batch=2)


@pytest.fixture(scope="module")
def plain_dpo(llama_dir, pairs, tmp_path_factory) -> dict[str, torch.Tensor]:
    return trained_weights(train(sgd_config(llama_dir, pairs, tmp_path_factory.mktemp("plain"))).output_dir)


def test_an_oom_in_a_dpo_step_gives_the_update_of_the_run_that_never_hit_it(llama_dir, pairs, plain_dpo, tmp_path):
    with _oom_above_one_pair() as raised:
        result = train(sgd_config(llama_dir, pairs, tmp_path))
    assert raised["n"] >= 2  # 4 pairs failed, then 2
    assert any(record.get("event") == "oom" for record in records(tmp_path))
    assert_same_weights(plain_dpo, trained_weights(result.output_dir), atol=1e-6)


def test_the_oom_check_fails_when_recovery_counts_gradients_twice(llama_dir, pairs, plain_dpo, tmp_path):
    with _oom_above_one_pair() as raised, freezing_ignored():
        result = train(sgd_config(llama_dir, pairs, tmp_path))
    assert raised["n"] >= 2
    with pytest.raises(AssertionError):
        assert_same_weights(plain_dpo, trained_weights(result.output_dir), atol=1e-6)


def test_an_oom_split_step_reports_the_metrics_of_the_unsplit_one(llama_dir, pairs, tmp_path):
    """The task's step metrics (the hook the loop reads) after one step, with and without the injected OOM."""
    from memfit.train.setup import build_session
    from memfit.train.step import StepRunner

    def one_step(out: Path, oom: bool) -> dict[str, float]:
        session = build_session(sgd_config(llama_dir, pairs, out))
        runner = StepRunner.from_session(session)
        indices = session.schedule.batch_indices(0)
        samples = session.task.prepare([session.dataset[i] for i in indices], indices, 0)
        if oom:
            with _oom_above_one_pair() as raised:
                runner.run(samples)
            assert raised["n"] >= 2
        else:
            runner.run(samples)
        runner.close()
        return session.task.step_metrics()

    plain, split = one_step(tmp_path / "plain", False), one_step(tmp_path / "split", True)
    assert set(REWARDS) <= set(plain) and plain.keys() == split.keys()
    assert split == pytest.approx(plain, rel=1e-5, abs=1e-6)

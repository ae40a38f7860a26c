"""The real `memfit train` command on tiny models saved to disk."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.train.metrics import read_metrics
from memfit_cli import run_memfit

STEP_FIELDS = {
    "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_second", "micro_batch_size",
    "gradient_accumulation_steps", "precision", "optimizer", "attention", "peak_memory_bytes",
}


@pytest.mark.parametrize("model_fixture", ["llama_dir", "gpt2_dir"])
def test_train_cli_end_to_end(model_fixture, request, text_file, tmp_path, warm_memfit):
    model_dir = request.getfixturevalue(model_fixture)
    out = tmp_path / "run"
    # forked from the session's warm server (tests/memfit_cli.py): `python -m memfit` as a fresh interpreter runs it,
    # without importing torch and transformers again
    result = warm_memfit.run(
        "train", "--model", model_dir, "--dataset", text_file, "--seq-len", "64", "--batch-size", "4",
        "--gradient-accumulation-steps", "2", "--max-steps", "8", "--lr", "3e-3", "--output-dir", out,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "memfit memory report" in result.stderr
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "event" not in r]
    assert len(steps) == 8
    assert STEP_FIELDS <= set(steps[0])
    assert steps[-1]["loss"] < steps[0]["loss"]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["steps"] == 8
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    # The final directory holds the whole trained model: every tensor of the original, moved by training.
    assert model.state_dict().keys() == initial.state_dict().keys()
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, initial.get_parameter(name))]
    assert len(moved) == len(list(initial.parameters())), set(dict(initial.named_parameters())) - set(moved)


def test_ai_os_style_command_line(llama_dir, text_file, tmp_path, warm_memfit):
    """AI-OS's conservative VRAM profile (`aios hrm-hf train-actv1`), with its exact switches."""
    log_file = tmp_path / "run" / "metrics.jsonl"
    result = warm_memfit.run(
        "train", "--model", llama_dir, "--dataset-file", text_file, "--steps", "3", "--batch-size", "1",
        "--gradient-accumulation-steps", "8", "--gradient-checkpointing", "--amp", "--use-8bit-optimizer",
        "--window-size", "64", "--log-file", log_file, "--output-dir", tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr
    steps = [r for r in read_metrics(log_file) if "event" not in r]
    assert steps[0]["precision"] == "bf16"  # --amp: bf16 autocast, which CPUs run
    assert steps[0]["optimizer"].startswith("adamw-8bit")
    assert steps[0]["micro_batch_size"] == 1 and steps[0]["gradient_accumulation_steps"] == 8
    start = read_metrics(log_file)[0]
    assert start["gradient_checkpointing"].startswith("full")


def _tree(directory) -> dict:
    """Every file under `directory` with its bytes (what a run must leave unchanged)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


BAD_INPUT = [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--seq-lenn", "64"], "did you mean --seq-len"),
    (["--memory-cap", "lots"], "is not a size"),
    (["--precision", "fp16"], "25x slower"),
    (["--model", "./no/such/model"], "does not exist"),
    (["--dataset", "missing.txt"], "missing.txt"),
    (["--config", "missing.yaml"], "missing.yaml does not exist"),
    (["--seq-len", "100000"], "lower --seq-len"),
    (["--dataset", "{empty}"], "holds no text"),
    (["--dataset", "{short}", "--seq-len", "64"], "fewer than one window"),
    (["--dataset", "{text}", "--seq-len", "256", "--batch-size", "512"], "fewer than one effective batch"),
    (["--optimizer-in-backward", "--max-grad-norm", "1.0"], "set --max-grad-norm 0"),
]


@pytest.mark.parametrize("existing", [False, True], ids=["new-output-dir", "existing-output-dir"])
@pytest.mark.parametrize("args, expected", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_nothing_written(args, expected, existing, tmp_path, llama_dir, text_file,
                                                      warm_memfit):
    """Exactly one line on stderr, exit 2, and the output directory not created (or left as it was).

    Each case is its own `memfit` process (forked from one that imported torch already: see memfit_cli.py).
    """
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "short.txt").write_text("a few words only")
    values = {"empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt", "text": text_file}
    args = [arg.format(**values) for arg in args]
    out = tmp_path / "out"
    if existing:  # a previous run's directory, which a refused run must not touch
        (out / "checkpoints").mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _tree(out) if existing else None
    base = ["train", "--output-dir", out, "--max-steps", "1"]
    if "--model" not in args:
        base += ["--model", llama_dir]
    result = warm_memfit.run(*base, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and expected in lines[0], result.stderr
    if existing:
        assert _tree(out) == before and sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl"]
    else:
        assert not out.exists()


OTHER_COMMANDS_BAD_INPUT = [
    (["estimate", "--model", "tiny", "--gpu", "rtx-9999", "--json"], "did you mean rtx-4090"),
    (["estimate", "--model", "no-such-model"], "unknown model"),
    (["plan", "--model", "tiny"], "needs --gpu NAME or --memory-budget SIZE"),
    (["profile", "--model", "tiny", "--steps", "0", "--output-dir", "{out}"], "--steps must be at least 1"),
    (["profile", "--model", "tiny", "--dataset", "{empty}", "--output-dir", "{out}"], "holds no text"),
    (["find-batch-size", "--model", "tiny", "--seq-lenn", "64", "--output-dir", "{out}"], "did you mean --seq-len"),
]


@pytest.mark.parametrize("args, expected", OTHER_COMMANDS_BAD_INPUT, ids=[a[0] + ":" + e for a, e in OTHER_COMMANDS_BAD_INPUT])
def test_other_commands_bad_input_is_one_line_exit_2_nothing_written(args, expected, tmp_path, warm_memfit):
    (tmp_path / "empty.txt").write_text("\n\n")
    out = tmp_path / "out"
    result = warm_memfit.run(*[arg.format(out=out, empty=tmp_path / "empty.txt") for arg in args])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and expected in lines[0], result.stderr
    assert result.stdout == "" and not out.exists()


def test_optimizer_in_backward_switches_default_clipping_off_visibly(llama_dir, text_file, tmp_path, warm_memfit):
    """Clipping is on by default, and --optimizer-in-backward cannot clip: it trains, and says it did not clip."""
    result = warm_memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--max-steps", "2",
                        "--batch-size", "2", "--optimizer-in-backward", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("memfit:") and "clipping is off" in line]
    assert len(said) == 1 and "--optimizer-in-backward" in said[0], result.stderr
    start = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert "gradient clipping is off" in start["fallbacks"]["max_grad_norm"]


def test_unknown_command_suggests():
    result = run_memfit("trian")
    assert result.returncode == 2 and "did you mean train" in result.stderr


def test_metrics_record_what_really_ran_when_8bit_is_missing(llama_dir, text_file, tmp_path, monkeypatch):
    """Without bitsandbytes and torchao the 8-bit optimizer falls back visibly."""
    import sys

    from memfit.config_loading import load_config
    from memfit.train.loop import train

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=4,
                                        max_steps=1, optimizer="adamw-8bit", output_dir=str(tmp_path)))
    result = train(config)
    assert result.summary["optimizer"].startswith("adamw (")
    assert "bitsandbytes" in result.summary["fallbacks"]["optimizer"]
    assert "more optimizer memory" in result.summary["fallbacks"]["optimizer"]
    assert torch.isfinite(torch.tensor(result.final_loss))
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["fallbacks"]["optimizer"]


def test_flash_attention_falls_back_visibly_on_cpu(llama_dir, text_file, tmp_path, warm_memfit):
    result = warm_memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--max-steps", "1",
                        "--attention", "flash", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "SDPA ran instead" in result.stderr
    start = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert start["attention"] == "sdpa" and "flash-attn" in start["fallbacks"]["attention"]


def test_embedded_default_trains(tmp_path, warm_memfit):
    """`memfit train` with only a step count: the built-in tiny model on the bundled corpus."""
    result = warm_memfit.run("train", "--max-steps", "3", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "built-in tiny" in result.stderr and "bundled corpus" in result.stderr
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r]
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_tensorboard_without_the_package_is_refused_before_writing(tmp_path, llama_dir, warm_memfit):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    result = warm_memfit.run("train", "--model", llama_dir, "--tensorboard", "--max-steps", "1", "--output-dir", tmp_path / "out")
    assert result.returncode == 2 and "pip install tensorboard" in result.stderr
    assert not (tmp_path / "out").exists()

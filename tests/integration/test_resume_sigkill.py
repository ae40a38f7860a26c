"""A run with dropout, killed with SIGKILL at a random step, resumes to the uninterrupted losses and weights.

Dropout makes every step draw from the random generator, so the resumed run matches only
if the checkpoint restores the generator's state; the twin test resumes with that restore
disabled (fault_shim: torch.set_rng_state does nothing) and must then differ.

Every run is a `memfit train` process forked from the warm server (tests/memfit_cli.py), one after another: the
killed one is sent SIGKILL by its process id, and the twin's child runs the fault shim before the command.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_FLAGS, fault_env
from memfit.train.metrics import read_metrics
from signal_runs import children

STEPS = 8


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 with dropout 0.1 on embeddings, attention and residuals."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from memfit.models.tiny import byte_tokenizer

    config = GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=256,
                        bos_token_id=256, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    directory = tmp_path_factory.mktemp("gpt2-dropout")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def _command(model: Path, text_file: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--dataset", str(text_file),
            "--seq-len", "64", "--batch-size", "2", "--gradient-accumulation-steps", "2", "--max-steps", str(STEPS),
            "--loss-chunk-size", "0", "--no-report", *SGD_FLAGS, "--momentum", "0.9", "--lr", "0.3", "--output-dir", str(out), *extra]


def _losses_after_last_start(path: Path) -> dict[int, float]:
    records = read_metrics(path)
    last_start = max(i for i, r in enumerate(records) if r.get("event") == "start")
    return {r["step"]: r["loss"] for r in records[last_start:] if "event" not in r}


@pytest.fixture(scope="module")
def runs(dropout_model, text_file, tmp_path_factory, warm_memfit):
    """The uninterrupted run, and a run killed with SIGKILL once its step-K checkpoint is complete (one after the
    other: the warm server runs one command at a time)."""
    root = tmp_path_factory.mktemp("sigkill")
    straight, killed = root / "straight", root / "killed"
    reference = warm_memfit.run(*_command(dropout_model, text_file, straight))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "Traceback" not in reference.stderr
    kill_after = random.SystemRandom().randint(1, STEPS // 2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=warm_memfit.run(
        *_command(dropout_model, text_file, killed, "--save-every", "1"))))
    thread.start()
    marker = killed / "checkpoints" / f"step-{kill_after}" / "trainer_state.json"
    deadline = time.monotonic() + 600
    while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    for child in children(warm_memfit._server.pid):  # the forked run: the server runs one command at a time
        os.kill(child, signal.SIGKILL)
    thread.join(timeout=600)
    assert result["done"].returncode == -signal.SIGKILL, f"the run ended before step {kill_after} could be killed"
    return {"straight": straight, "killed": killed, "kill_after": kill_after, "root": root}


@pytest.fixture(scope="module")
def resumed(runs, dropout_model, text_file, warm_memfit) -> dict[str, Path]:
    """The killed run resumed twice, in copies of its directory: as it is, and with the RNG restore disabled
    (fault_shim)."""
    outs = {}
    for name, extra, env in (("resumed", ["--save-every", "1"], {}),
                             ("resumed-without-rng", [], fault_env(keep_rng=True))):
        outs[name] = runs["root"] / name
        shutil.copytree(runs["killed"], outs[name])
        done = warm_memfit.run(*_command(dropout_model, text_file, outs[name], *extra, "--resume", "auto"), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
    return outs


def test_killed_run_with_dropout_resumes_to_the_uninterrupted_run(runs, resumed):
    expected = _losses_after_last_start(runs["straight"] / "metrics.jsonl")
    losses = _losses_after_last_start(resumed["resumed"] / "metrics.jsonl")
    context = f"killed after step {runs['kill_after']}"
    assert max(losses) == STEPS and min(losses) > runs["kill_after"], context
    assert losses == pytest.approx({step: expected[step] for step in losses}, abs=1e-6), context
    a = load_file(str(runs["straight"] / "final" / "model.safetensors"))
    b = load_file(str(resumed["resumed"] / "final" / "model.safetensors"))
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, atol=1e-6, rtol=0, msg=f"{name} ({context})")


def test_resume_check_fails_when_the_rng_state_is_not_restored(runs, resumed):
    expected = _losses_after_last_start(runs["straight"] / "metrics.jsonl")
    losses = _losses_after_last_start(resumed["resumed-without-rng"] / "metrics.jsonl")
    assert losses != pytest.approx({step: expected[step] for step in losses}, abs=1e-6)

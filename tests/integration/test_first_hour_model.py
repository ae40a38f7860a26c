"""A newcomer's first hour: an unknown model name, a cached one, and the lines every run prints.

Every command here runs with the Hub "online" (HF_HUB_OFFLINE=0) at an address where nothing listens
(HF_ENDPOINT=http://127.0.0.1:9): a look-up is refused at once, and no test reaches the internet. The
Hugging Face cache is the module's own folder, holding one model (`CACHED`).
"""

from __future__ import annotations

import time

import pytest
import torch

CACHED = "memfit-test/tiny-llama"
UNKNOWN = "llama-9000-tiny"


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """A Hugging Face cache (its own layout: refs/main -> snapshots/<commit>/) holding CACHED, a tiny Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    cache = tmp_path_factory.mktemp("hf-cache")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + CACHED.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=256, pad_token_id=256, bos_token_id=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(repo / "snapshots" / commit)
    byte_tokenizer().save_pretrained(repo / "snapshots" / commit)
    return cache


@pytest.fixture(scope="module")
def memfit(hf_cache):
    """`memfit ARGS` forked from a server that imported huggingface_hub under this module's environment (its
    settings are read at import), warmed up on a refusal so that a refusal's time is the command's own."""
    from memfit_cli import WarmMemfit

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "0")
        patch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # connection refused, at once
        patch.setenv("HF_HUB_CACHE", str(hf_cache))
        server = WarmMemfit("estimate", "--model", "nobody-memfit/" + UNKNOWN)
        yield server
        server.close()


def _own_stderr(memfit, result) -> list[str]:
    """The command's stderr lines, without what the server printed while importing (put in front of each)."""
    return result.stderr.removeprefix(memfit.import_stderr).splitlines()


REFUSED = [
    ["train", "--model", UNKNOWN, "--output-dir", "{out}"],
    ["train", "--model", "nobody-memfit/" + UNKNOWN, "--output-dir", "{out}"],
    ["estimate", "--model", UNKNOWN],
    ["estimate", "--model", "nobody-memfit/" + UNKNOWN],
    ["plan", "--model", "nobody-memfit/" + UNKNOWN, "--gpu", "rtx-4090"],
    ["profile", "--model", UNKNOWN, "--output-dir", "{out}"],
    ["find-batch-size", "--model", UNKNOWN, "--output-dir", "{out}"],
    ["data", "builtin:chat", "--model", UNKNOWN],
    ["train", "--model", "./" + UNKNOWN, "--output-dir", "{out}"],
    ["train", "--model", "preset:" + UNKNOWN, "--output-dir", "{out}"],
]


@pytest.mark.parametrize("args", REFUSED, ids=[" ".join(a[:3]) for a in REFUSED])
def test_an_unknown_name_is_refused_in_one_line_at_once(args, memfit, tmp_path):
    """Before: 20 "Retrying in Ns" lines and 52 s. Now one line naming the closest names, exit 2, nothing written."""
    out = tmp_path / "out"
    started = time.perf_counter()
    result = memfit.run(*[a.format(out=out) for a in args])
    elapsed = time.perf_counter() - started
    lines = _own_stderr(memfit, result)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"memfit {args[0]}: error: "), result.stderr
    assert "did you mean " in lines[0] and "Retrying" not in result.stderr
    assert elapsed < 2.0, f"{elapsed:.1f} s: {lines}"  # generous: no retry waits a second
    assert result.stdout.removeprefix(memfit.import_stdout) == "" and not out.exists()


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(memfit, tmp_path, text_file):
    """Before: every optional file of the model (adapter, chat template, ...) asked of the Hub and retried,
    3.5 minutes. Now one look-up, then the cache alone, said in one line."""
    started = time.perf_counter()
    result = memfit.run("train", "--model", CACHED, "--dataset", text_file, "--seq-len", "32", "--batch-size", "1",
                        "--max-steps", "1", "--output-dir", tmp_path / "run", "--no-report")
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    lines = _own_stderr(memfit, result)
    assert f"memfit: {CACHED} is read from the Hugging Face cache (the Hub could not be reached:" in lines[0]
    assert f"memfit: model Hugging Face {CACHED}: " in result.stderr
    assert "Retrying" not in result.stderr and "thrown while requesting" not in result.stderr
    assert elapsed < 120, elapsed  # minutes before (each missing optional file waited 31 s of retries)
    estimate = memfit.run("estimate", "--model", CACHED, "--json")
    assert estimate.returncode == 0, estimate.stderr


def test_a_local_directory_still_loads(memfit, llama_dir, text_file, tmp_path):
    result = memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--batch-size", "1",
                        "--max-steps", "1", "--output-dir", tmp_path / "run", "--no-report")
    assert result.returncode == 0, result.stderr
    assert f"memfit: model directory {llama_dir}: " in result.stderr


def test_a_lora_run_prints_no_library_warning(memfit, llama_dir, text_file, tmp_path):
    """transformers' `is_gradient_checkpointing is deprecated`, read by PEFT as it wraps the model, is gone."""
    result = memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--batch-size", "1",
                        "--max-steps", "1", "--lora-r", "8", "--output-dir", tmp_path / "run", "--no-report")
    assert result.returncode == 0, result.stderr
    stderr = "\n".join(_own_stderr(memfit, result))
    assert "memfit: LoRA r=8" in stderr
    assert "Warning" not in stderr and "[transformers]" not in stderr, stderr


def test_a_new_head_is_said_in_one_line_of_memfit(memfit, tmp_path):
    """transformers' 17-line LOAD REPORT is held back; memfit names the new weights (the head) in one line."""
    from tiny_encoders import dna_rows, save_encoder, write_csv

    encoder = save_encoder(tmp_path / "bert")
    table = write_csv(tmp_path / "train.csv", dna_rows(24))
    result = memfit.run("train", "--model", encoder, "--task", "sequence-classification", "--dataset", table,
                        "--batch-size", "4", "--max-steps", "1", "--output-dir", tmp_path / "run", "--no-report")
    assert result.returncode == 0, result.stderr
    lines = _own_stderr(memfit, result)
    assert "LOAD REPORT" not in result.stderr and not any("0 of" in line for line in lines), result.stderr
    said = [line for line in lines if line.startswith("memfit: weights newly initialised")]
    assert len(said) == 1 and said[0].startswith(f"memfit: weights newly initialised (not in {encoder}; --seed ")
    assert said[0].endswith("): bert.pooler.dense, classifier; left unused from it: cls.predictions (5 tensors)")


def test_the_default_run_says_what_ran_and_nothing_else(memfit, tmp_path):
    """The embedded default: the lines that say what ran stay; "efficient RMSNorm: 9 of 9 norms" and the disk
    line go to the debug log (MEMFIT_LOG_LEVEL=DEBUG)."""
    result = memfit.run("train", "--max-steps", "1", "--output-dir", tmp_path / "run", "--no-report")
    assert result.returncode == 0, result.stderr
    lines = _own_stderr(memfit, result)
    assert not any("0 of" in line for line in lines), lines
    assert not any(line.startswith(("memfit: efficient", "memfit: disk:")) for line in lines), lines
    for said in ("memfit: model built-in tiny", "memfit: data bundled corpus", "memfit: 1 steps x",
                 "memfit: precision fp32 | optimizer"):
        assert any(line.startswith(said) for line in lines), (said, lines)

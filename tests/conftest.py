"""Shared fixtures: tiny models saved to disk (read back through the real loader), small data."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

# One torch thread per process, here and (through the environment) in every command a test starts.
# The tests' models are tiny, so a second thread gains them little, while on a busy 2-core machine the
# default pool's threads spin against the other processes' (the distributed ranks', concurrent runs')
# and multiply the CPU time (docs/testing.md, Timings). An OMP_NUM_THREADS set by the caller is kept.
THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
os.environ.setdefault("MKL_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)
# As `make test` exports it: DeepSpeed on its CPU accelerator, named rather than detected, so that importing DeepSpeed
# prints no detection warning on stdout (the warm server's imports are printed in front of every command it forks).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Trials and the speed calibration (docs/planning.md) measure into a cache of this test session, never the
# user's ~/.cache/memfit: a CPU plan a test pins would otherwise follow what earlier runs measured here.
os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-cache-")


@pytest.fixture(autouse=True)
def _speed_cache_of_this_test(tmp_path_factory, monkeypatch):
    """Each test its own speed cache: what one test's planned run measured never ranks another's plan."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))


# Under pytest-xdist (`make test` runs `-n auto --dist loadgroup`), what shares an expensive fixture runs in one
# worker: a test file's tests together (its module fixtures: saved models, reference runs), and every file that
# reads the shared torchrun launches of tests/distributed/conftest.py together (session fixtures that several
# files read). The other files of tests/distributed (their own launches) are groups of their own, so the two
# workers can run them beside the shared launch.
SHARED_LAUNCH_GROUP = "torchrun-launches"
SHARED_LAUNCH_FIXTURES = frozenset({"references", "shared_launch"})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # A whole file joins the shared group when any of its tests reads a shared launch (its module fixtures
    # stay in one worker).
    sharing = {item.path for item in items if SHARED_LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ()))}
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.get_closest_marker("xdist_group") is None:
            group = SHARED_LAUNCH_GROUP if item.path in sharing else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


def _save_model(directory: Path, config) -> Path:
    from transformers import AutoModelForCausalLM

    from memfit.models.tiny import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama-shaped model with the byte tokenizer, saved with save_pretrained."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=256, pad_token_id=256, bos_token_id=256,
    )
    return _save_model(tmp_path_factory.mktemp("llama"), config)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A 2-layer GPT-2-shaped model (tied embeddings, learned positions)."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=257, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=256, bos_token_id=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would make runs differ by RNG use
    )
    return _save_model(tmp_path_factory.mktemp("gpt2"), config)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """Documents of varied length (10 to 400 characters), separated by blank lines."""
    rng = random.Random(0)
    words = "memory gradient batch token model layer the a of to in training fits device loss step".split()
    documents = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 80))) for _ in range(300)]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(documents))
    return path


@pytest.fixture(scope="session")
def warm_memfit(llama_dir, text_file):
    """`warm_memfit.run(*args)`: the real `memfit` command in a process forked from one that imported torch already."""
    from memfit_cli import WarmMemfit

    # Warm-up: one whole 1-step run (load, step, checkpoint, report, final save), so that the server holds every module a
    # run imports on its way: transformers loads its modeling code lazily and saving imports accelerate and through it
    # DeepSpeed, several seconds that every forked command would otherwise pay again (docs/testing.md).
    server = WarmMemfit("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--batch-size", "1",
                        "--max-steps", "1", "--save-every", "1", "--output-dir", "{scratch}/warmup")
    yield server
    server.close()

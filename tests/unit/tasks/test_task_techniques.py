"""Memory techniques on encoder tasks: checkpointing saves tracked bytes without changing the update, LoRA trains
the new head in full, and what cannot apply to a task is refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from tiny_encoders import dna_rows, write_csv


@pytest.fixture(scope="module")
def long_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("long") / "long.csv", dna_rows(16, seed=1, min_length=180, max_length=250))


def _run(model_dir, data, out, **extra):
    values = dict(model=str(model_dir), dataset=str(data), task="sequence-classification", seq_len=256, batch_size=8,
                  max_steps=2, lr=0.5, output_dir=str(out), report=False, track_memory=True, **SGD_NO_CLIPPING)
    result = train(load_config(overrides=values | extra))
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]
    return result, max(r["tracked_peak_bytes"] for r in steps)


@pytest.mark.parametrize("family", ["bert", "esm"])
def test_checkpointing_the_encoder_stack_saves_bytes_and_keeps_the_update(encoder_dirs, long_csv, tmp_path, family):
    plain, plain_peak = _run(encoder_dirs[family], long_csv, tmp_path / "plain")
    checkpointed, checkpointed_peak = _run(encoder_dirs[family], long_csv, tmp_path / "full", gradient_checkpointing="full")
    assert checkpointed_peak < 0.8 * plain_peak, (checkpointed_peak, plain_peak)
    a = load_file(str(plain.final_dir / "model.safetensors"))
    b = load_file(str(checkpointed.final_dir / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)


def test_lora_trains_the_new_head_in_full_and_freezes_the_base(encoder_dirs, dna_csv, tmp_path):
    config = load_config(overrides=dict(model=str(encoder_dirs["esm"]), dataset=str(dna_csv), task="sequence-classification",
                                        seq_len=64, batch_size=8, max_steps=2, lr=0.5, output_dir=str(tmp_path),
                                        report=False, lora_r=4, **SGD_NO_CLIPPING))
    result = train(config)
    adapter = load_file(str(result.final_dir / "adapter_model.safetensors"))
    head = [name for name in adapter if "classifier" in name]
    assert head and any("lora_" in name for name in adapter)
    # The saved head is trained: it differs from the head a fresh load initialises from the same seed.
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(config.training.seed)
    fresh = AutoModelForSequenceClassification.from_pretrained(encoder_dirs["esm"], num_labels=3).state_dict()
    trained = {name.split("modules_to_save.default.")[-1].replace("base_model.model.", ""): adapter[name] for name in head}
    assert any(not torch.equal(tensor, fresh[name]) for name, tensor in trained.items() if name in fresh)


@pytest.mark.parametrize(("flags", "message"), [
    (["--loss-chunk-size", "512"], "--loss-chunk-size chunks vocabulary logits; --task sequence-classification"),
    (["--packing", "samples"], "--packing samples puts several samples in one row"),
    (["--num-labels", "2"], "--num-labels 2 is fewer than the 3 classes"),
])
def test_what_cannot_apply_is_refused_in_one_line(encoder_dirs, dna_csv, tmp_path, flags, message, warm_memfit):
    # forked from the warm server (tests/memfit_cli.py): the refusal is the real command's, without a fresh import
    run = warm_memfit.run("train", "--model", str(encoder_dirs["bert"]), "--task", "sequence-classification",
                          "--dataset", str(dna_csv), "--max-steps", "1", "--no-report", "--output-dir",
                          str(tmp_path / "out"), *flags)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()

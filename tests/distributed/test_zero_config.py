"""The DeepSpeed config memfit runs: "auto" filled from memfit's settings, conflicts named."""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.distributed.zero import deepspeed_config, read_deepspeed_file
from memfit.errors import UsageError


def _config(**values):
    return load_config(
        overrides={"batch_size": 2, "gradient_accumulation_steps": 4, "lr": 3e-4, "max_grad_norm": 0.5} | values
    )


def test_auto_values_are_filled_from_memfit():
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
    }
    result = deepspeed_config(_config(), world_size=2, accumulation=4, precision_name="bf16", user=user)
    assert result["train_micro_batch_size_per_gpu"] == 2
    assert result["gradient_accumulation_steps"] == 4
    assert result["train_batch_size"] == 16
    assert result["gradient_clipping"] == 0.5
    assert result["bf16"]["enabled"] is True and result["fp16"]["enabled"] is False
    assert result["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    assert result["zero_optimization"] == {"stage": 3}  # unresolved bucket sizes: DeepSpeed's defaults
    assert user["train_batch_size"] == "auto"  # the user's dict is not modified


def test_flags_generate_a_config():
    result = deepspeed_config(_config(zero_stage=3, zero_offload=True), 1, 4, "fp32")
    assert result["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    assert result["train_batch_size"] == 8 and result["bf16"]["enabled"] is False
    stage2 = deepspeed_config(_config(zero_stage=2, zero_offload=True), 1, 4, "fp32")["zero_optimization"]
    assert "offload_param" not in stage2 and stage2["offload_optimizer"] == {"device": "cpu"}


def test_explicit_batch_values_must_agree():
    with pytest.raises(UsageError, match="train_micro_batch_size_per_gpu is 8 .* memfit runs 2"):
        deepspeed_config(_config(), 1, 4, "fp32", user={"train_micro_batch_size_per_gpu": 8})


def test_scheduler_section_is_dropped_with_a_note():
    fallbacks: dict = {}
    result = deepspeed_config(_config(), 1, 4, "fp32", user={"scheduler": {"type": "WarmupLR"}}, fallbacks=fallbacks)
    assert "scheduler" not in result and "lr-schedule" in fallbacks["deepspeed_scheduler"]


def test_unfillable_auto_is_an_error():
    with pytest.raises(UsageError, match="activation_checkpointing.partition_activations"):
        deepspeed_config(_config(), 1, 4, "fp32", user={"activation_checkpointing": {"partition_activations": "auto"}})


def test_bad_file(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        read_deepspeed_file(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{stage: 2")
    with pytest.raises(UsageError, match="not valid JSON"):
        read_deepspeed_file(str(broken))


def test_one_process_without_flags_runs_the_single_process_engine():
    import torch

    from memfit.distributed.context import DistContext
    from memfit.techniques.precision import resolve_precision
    from memfit.train.engine import SingleProcessEngine, choose_engine

    fallbacks: dict = {}
    config = _config(sharding="fsdp")
    device = torch.device("cpu")
    engine = choose_engine(config, DistContext(), device, resolve_precision("fp32", device), fallbacks)
    assert isinstance(engine, SingleProcessEngine)
    assert "needs several ranks" in fallbacks["sharding"]


def test_fp16_file_on_a_cpu_runs_fp32_visibly():
    """A DeepSpeed file written for GPUs ("fp16": {"enabled": true}) would stop DeepSpeed on a CPU."""
    import torch

    fallbacks: dict = {}
    user = {"fp16": {"enabled": True, "loss_scale": 0}, "zero_optimization": {"stage": 2}}
    result = deepspeed_config(_config(), 1, 4, "fp32", user=user, fallbacks=fallbacks, device=torch.device("cpu"))
    assert result["fp16"]["enabled"] is False and result["bf16"]["enabled"] is False
    assert "ran fp32" in fallbacks["deepspeed_fp16"] and '"auto"' in fallbacks["deepspeed_fp16"]
    with_bf16 = deepspeed_config(_config(), 1, 4, "bf16", user=user, fallbacks={}, device=torch.device("cpu"))
    assert with_bf16["fp16"]["enabled"] is False and with_bf16["bf16"]["enabled"] is True
    # Where DeepSpeed runs fp16 (a GPU), the file is left as written.
    on_gpu = deepspeed_config(_config(), 1, 4, "fp32", user=user, fallbacks={}, device=torch.device("cuda"))
    assert on_gpu["fp16"]["enabled"] is True


def test_bf16_and_fp16_together_are_refused():
    import torch

    user = {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
    with pytest.raises(UsageError, match='enables both "bf16" and "fp16"'):
        deepspeed_config(_config(), 1, 4, "fp32", user=user, device=torch.device("cpu"))


@pytest.mark.slow
def test_fp16_file_on_a_cpu_is_checked_before_deepspeed_starts(tmp_path, llama_dir, text_file, warm_memfit,
                                                                monkeypatch):
    """Through the CLI: no traceback, the switch in the log and the metrics, or (without the
    deepspeed package) one line that names the package: the precision never reaches DeepSpeed."""
    import json

    from torchrun_helpers import EXTENSIONS_CACHE, deepspeed_available

    from memfit.train.metrics import read_metrics
    from memfit_cli import run_memfit

    ds_file = tmp_path / "ds_config.json"
    ds_file.write_text(json.dumps({
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    }))
    out = tmp_path / "run"
    args = ["--model", llama_dir, "--dataset", text_file, "--seq-len", "32", "--max-steps", "1", "--batch-size", "2",
            "--deepspeed", ds_file, "--output-dir", out]
    if not deepspeed_available():
        result = run_memfit("train", *args)
        assert result.returncode == 2 and "pip install deepspeed" in result.stderr and "Traceback" not in result.stderr
        return
    # Forked from the session's warm server (tests/memfit_cli.py), with the caller's environment: DeepSpeed's CPU
    # op build is kept between runs, and torch and transformers are not imported again
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_CACHE))
    result = warm_memfit.run("train", *args)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "not supported on your device" not in result.stderr
    assert "fp16, which memfit does not run on a CPU" in result.stderr and "ran fp32 instead" in result.stderr
    summary = read_metrics(out / "metrics.jsonl")[-1]
    assert "ran fp32" in summary["fallbacks"]["deepspeed_fp16"] and summary["precision"] == "fp32"

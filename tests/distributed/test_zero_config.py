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
    notes: dict = {}
    result = deepspeed_config(_config(), 1, 4, "fp32", user={"scheduler": {"type": "WarmupLR"}}, notes=notes)
    assert "scheduler" not in result and "lr-schedule" in notes["deepspeed_scheduler"]


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


def test_one_process_without_flags_has_no_engine():
    import torch

    from memfit.distributed.context import DistContext
    from memfit.distributed.parallel import prepare_parallel

    notes: dict = {}
    config = _config(sharding="fsdp")
    assert prepare_parallel(config, torch.nn.Linear(2, 2), DistContext(), torch.device("cpu"), None, notes) is None
    assert "needs several ranks" in notes["sharding"]

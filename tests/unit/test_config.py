"""Configuration: YAML and flags, aliases of other trainers (Hugging Face Trainer, AI-OS), sizes, and errors that say what to do."""

from __future__ import annotations

import pytest

from memfit.cli.flags import parse_command_line
from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.units import format_bytes, parse_size


def test_sizes():
    assert parse_size("16GiB") == 16 * 1024**3
    assert parse_size("24GB") == 24 * 1000**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("12000MiB") == 12000 * 1024**2
    assert parse_size("1048576") == 1048576
    assert format_bytes(1.5 * 1024**3) == "1.50 GiB"
    for bad in ("12 potatoes", "-1GiB", "GiB", "0"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_other_trainers_flags_keep_their_meaning():
    config, _ = parse_command_line([
        "--per-device-train-batch-size", "4", "--window-size", "128", "--amp", "--use-8bit-optimizer",
        "--gradient-checkpointing", "--gradient-accumulation-steps", "8", "--log-file", "m.jsonl",
    ])
    assert config.training.batch_size == 4
    assert config.data.seq_len == 128
    assert config.memory.precision == "amp"
    assert config.optimizer.optimizer == "adamw-8bit"
    assert config.memory.gradient_checkpointing == "full"
    assert config.training.gradient_accumulation_steps == 8
    assert config.output.log_file == "m.jsonl"
    config, _ = parse_command_line(["--no-amp", "--no-gradient-checkpointing", "--gradient-checkpointing", "selective"])
    assert config.memory.precision == "fp32"
    assert config.memory.gradient_checkpointing == "selective"
    config, _ = parse_command_line(["--no-gradient-checkpointing", "--no-oom-recovery", "--memory-cap=2GiB"])
    assert config.memory.gradient_checkpointing == "off"
    assert config.memory.oom_recovery is False
    assert config.memory.memory_cap == 2 * 1024**3


def test_yaml_sections_aliases_and_flag_override(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "model: gpt2\n"
        "training_args:\n"
        "  per_device_train_batch_size: 4\n"
        "  gradient_accumulation_steps: 8\n"
        "  gradient_checkpointing: true\n"
        "  optim: adamw_8bit\n"
        "  learning_rate: 2.0e-4\n"
        "data:\n"
        "  seq_len: 512\n"
        "memory:\n"
        "  memory_cap: 16GiB\n"
    )
    config = load_config(path)
    assert config.model.model == "gpt2"
    assert config.training.batch_size == 4
    assert config.memory.gradient_checkpointing == "full"
    assert config.optimizer.optimizer == "adamw-8bit"
    assert config.optimizer.lr == 2e-4
    assert config.data.seq_len == 512
    assert config.memory.memory_cap == 16 * 1024**3
    config, _ = parse_command_line(["--config", str(path), "--batch-size", "2", "--seq-len", "64"])
    assert config.training.batch_size == 2 and config.data.seq_len == 64
    assert config.training.gradient_accumulation_steps == 8


def test_every_problem_reported_once_with_suggestions(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  batch_sise: 4\n  seq_len: 0\n")
    with pytest.raises(UsageError) as error:
        load_config(path)
    message = str(error.value)
    assert "batch_sise" in message and "did you mean batch_size" in message
    assert "seq-len must be at least 1" in message
    with pytest.raises(UsageError) as error:
        parse_command_line(["--seq-lenn", "3", "--memory-cap", "12 potatoes", "--optimizer", "adamw8"])
    message = str(error.value)
    assert "--seq-lenn (did you mean --seq-len?)" in message
    assert "12 potatoes" in message
    assert "--optimizer must be one of" in message
    assert "\n" not in message


def test_validation_names_the_flags():
    for overrides, expected in (
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"quantize": "4bit"}, "add --lora-r"),
        ({"effective_batch_size": 10, "batch_size": 4}, "not a multiple"),
        ({"stride": 300, "seq_len": 256}, "--stride"),
    ):
        with pytest.raises(UsageError, match=expected):
            load_config(overrides=overrides)


def test_effective_batch_derives_accumulation():
    config = load_config(overrides={"batch_size": 4, "effective_batch_size": 32})
    assert config.accumulation_for(1) == 8
    assert config.accumulation_for(2) == 4
    assert config.effective_batch_for(2) == 32


def test_help_lists_every_field_with_its_docstring(capsys):
    from memfit.cli.main import main

    assert main(["train", "--help-all"]) == 0  # --help shows the flags to start with (tests/unit/test_help.py)
    out = capsys.readouterr().out
    assert "--gradient-checkpointing" in out and "Recompute activations" in out
    assert "--memory-cap" in out


def test_optimizer_in_backward_switches_default_clipping_off():
    """Clipping needs every gradient at once; the default gives way, an explicit value does not."""
    config = load_config(overrides={"optimizer_in_backward": True})
    assert config.optimizer.max_grad_norm == 0.0
    assert "clipping is off" in config.derived["max_grad_norm"]
    # A copy keeps the derived value, and derives again when its cause goes away.
    assert config.replace(lr=0.01).optimizer.max_grad_norm == 0.0
    restored = config.replace(optimizer_in_backward=False)
    assert restored.optimizer.max_grad_norm == 1.0 and not restored.derived

    explicit = load_config(overrides={"optimizer_in_backward": True, "max_grad_norm": "0.5"})
    assert explicit.optimizer.max_grad_norm == 0.5 and not explicit.derived
    assert load_config(overrides={"max_grad_norm": "0.5"}).replace(optimizer_in_backward=True).optimizer.max_grad_norm == 0.5
    assert load_config().optimizer.max_grad_norm == 1.0



def test_reward_function_given_several_times_is_one_setting():
    """--reward-function may be repeated: its values are joined with commas; another flag given twice is not."""
    config, _ = parse_command_line(["--task", "grpo", "--reward-function", "answer-match", "--lr", "1e-4",
                                    "--reward-function", "format", "--lr", "2e-4"])
    assert config.rl.reward_function == "answer-match,format"
    assert config.optimizer.lr == 2e-4
    assert parse_command_line(["--task", "grpo", "--reward-function", "length"])[0].rl.reward_function == "length"


def test_a_choice_spelled_with_an_underscore_is_taken_as_given():
    """TRL's `dr_grpo` is a --loss-type choice as it is spelled; a hyphenated choice still takes underscores."""
    assert load_config(overrides={"task": "grpo", "loss_type": "dr_grpo"}).task.loss_type == "dr_grpo"
    assert load_config(overrides={"task": "grpo", "loss_type": "DR_GRPO"}).task.loss_type == "dr_grpo"
    assert load_config(overrides={"task": "dpo", "pair_layout": "shared_prompt"}).task.pair_layout == "shared-prompt"


def test_preset_tiny_points_at_the_built_in_model():
    from memfit.errors import UsageError
    from memfit.models.model_names import check_model_name

    with pytest.raises(UsageError, match="give --model tiny"):
        check_model_name("preset:tiny")

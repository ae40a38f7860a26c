"""The `memfit train` command a plan prints runs what was planned: the task, its objective and the data's settings included."""

from __future__ import annotations

import shlex

from memfit.cli.flags import parse_command_line
from memfit.config_loading import load_config
from memfit.prediction.trade_offs import train_command


def _command(**settings) -> list[str]:
    config = load_config(None, settings)
    return shlex.split(train_command(config, {"batch_size": 4, "lora_r": 16}, gpu=None, budget=None))


def test_a_preference_plan_keeps_its_task_and_objective():
    argv = _command(task="dpo", beta=0.25, reference="copy", loss_type="ipo", dataset="builtin:preferences")
    for flag, value in (("--task", "dpo"), ("--beta", "0.25"), ("--reference", "copy"), ("--loss-type", "ipo")):
        assert argv[argv.index(flag) + 1] == value, argv
    assert argv[argv.index("--batch-size") + 1] == "4"


def test_a_classifier_plan_keeps_its_labels():
    argv = _command(task="sequence-classification", problem_type="multi-label", label_fields="a,b")
    assert argv[argv.index("--problem-type") + 1] == "multi-label"
    assert argv[argv.index("--label-fields") + 1] == "a,b"


def test_grpo_plan_keeps_rl_settings_but_not_what_memfit_derived():
    argv = _command(task="grpo", num_generations=4, reward_function="answer-match")
    assert argv[argv.index("--num-generations") + 1] == "4"
    assert argv[argv.index("--reward-function") + 1] == "answer-match"
    assert "--beta" not in argv and "--loss-type" not in argv  # grpo's own defaults, derived again by the run


def test_the_printed_command_parses_back_to_the_same_task():
    argv = _command(task="kto", desirable_weight=1.5)
    config, _ = parse_command_line(argv[2:])
    assert (config.task.task, config.task.desirable_weight, config.training.batch_size) == ("kto", 1.5, 4)

"""`memfit data --task dpo --dataset builtin:preferences --model DIR`: preference pairs as the model sees them.

The command's own code (cli/data.py: inspect_dataset, render) runs in process on a config whose task is a
preference task, with the saved tiny Llama's tokenizer; the real command runs too once the task is a --task choice.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from memfit.cli.data import inspect_dataset, render
from memfit.config_loading import load_config
from memfit.config_sections import TASKS
from memfit.data.records import builtin_path


def preference_config(llama_dir, task: str = "dpo", *flags: tuple[str, str]):
    config = load_config(None, [("dataset", "builtin:preferences"), ("model", str(llama_dir)),
                                ("chat-template", "chatml"), *flags])
    config.task = dataclasses.replace(config.task, task=task)  # set past the flag's choices, which may not list it yet
    return config


def first_record() -> dict:
    return json.loads(builtin_path("preferences").read_text().splitlines()[0])


def test_memfit_data_shows_a_pair_its_scored_tokens_and_the_lengths(llama_dir):
    report = inspect_dataset(preference_config(llama_dir), show=1)
    assert report["preference"] and report["format"] == "preference" and report["records"] == 50
    shown = report["shown"][0]
    record = first_record()
    assert record["prompt"][-1]["content"] in shown["prompt"] and shown["prompt"].endswith("<|im_start|>assistant\n")
    chosen, rejected = shown["completions"]
    assert chosen["text"] == record["chosen"][0]["content"] + "<|im_end|>\n"
    assert rejected["text"] == record["rejected"][0]["content"] + "<|im_end|>\n"
    # The model's 256 positions cap the length from the data: the longest pairs do not fit and are counted.
    assert report["seq_len"] == 256 and report["lengths"]["item"]["max"] > 256
    assert report["length_policy"]["samples_dropped_long"] == report["items"] - report["kept"] > 0
    text = render(report)
    assert f"[[{record['chosen'][0]['content']}<|im_end|>\n]]" in text
    assert f"[[{record['rejected'][0]['content']}<|im_end|>\n]]" in text
    assert "pair lengths" in text and "median" in text and "p99" in text and "max" in text
    assert "drops" in text and "--truncate" in text


def test_memfit_data_of_kto_shows_labelled_completions(llama_dir):
    config = preference_config(llama_dir, "kto", ("seq-len", "200"), ("truncate", "true"))
    report = inspect_dataset(config, show=2)
    assert not report["paired"] and report["items"] == 100 and report["desirable"] is not None
    text = render(report)
    assert "--- completion 1 (record 1, desirable)" in text and "labels:" in text


@pytest.mark.skipif("dpo" not in TASKS, reason="--task dpo is not a choice of this build yet")
def test_the_real_command(warm_memfit, llama_dir):
    shown = warm_memfit.run("data", "--task", "dpo", "--dataset", "builtin:preferences", "--model", llama_dir,
                            "--chat-template", "chatml", "--show", "1")
    assert shown.returncode == 0, shown.stderr
    assert "--- pair 1 (record 1)" in shown.stdout and "[[" in shown.stdout and "pair lengths" in shown.stdout
    as_json = warm_memfit.run("data", "builtin:preferences", "--task", "dpo", "--model", llama_dir,
                              "--chat-template", "chatml", "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert report["preference"] and len(report["shown"]) == 3 and report["lengths"]["item"]["count"] == 50


@pytest.mark.parametrize("task", ["dpo", "kto", "grpo"])
def test_memfit_plan_takes_the_length_from_pairs_and_prompts(llama_dir, task):
    """`memfit plan --dataset` reads a preference file's pairs (the prompt and the longer answer) and a GRPO file's
    prompts as those tasks read them, where the causal-LM reader finds none of its fields."""
    from memfit.cli.data import plan_from_dataset
    from memfit.data.preferences import load_preference_data
    from memfit.data.prompts import load_prompts
    from memfit.models.loader import load_tokenizer

    dataset = "builtin:prompts" if task == "grpo" else "builtin:preferences"
    config = load_config(None, [("dataset", dataset), ("model", str(llama_dir)), ("chat-template", "chatml"),
                                ("task", task)])
    planned, facts = plan_from_dataset(config)
    tokenizer = load_tokenizer(str(llama_dir), False)
    unlimited = dataclasses.replace(config.data, seq_len=1 << 30, truncate=False)
    if task == "grpo":
        lengths = [len(item.prompt_ids) for item in load_prompts(unlimited, tokenizer, say=False)]
    else:  # KTO reads each pair as two unpaired completions
        segments = load_preference_data(unlimited, tokenizer, task=task, say=False).segment_lengths
        lengths = (segments[:, 0] + segments[:, 1:].max(axis=1)).tolist()
    assert facts["max"] == max(lengths) and facts["samples"] == len(lengths)
    longest = max(lengths)
    assert planned.data.seq_len >= min(longest, 256)

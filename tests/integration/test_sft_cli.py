"""Supervised fine-tuning through the real CLI: builtin:chat end to end, `memfit data`, bad input, other trainers' names."""

from __future__ import annotations

import json

import pytest

from memfit.config_loading import load_config

CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}]


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_train_builtin_chat_end_to_end(tmp_path, warm_memfit):
    out = tmp_path / "run"
    result = warm_memfit.run("train", "--dataset", "builtin:chat", "--seq-len", "512", "--allow-drop", "--batch-size", "4",
                             "--max-steps", "3", "--output-dir", out, "--no-report")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("memfit: data builtin:chat")]
    assert len(said) == 1 and "loss on assistant" in said[0] and "carry loss" in said[0], result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "start")
    assert start["data"]["format"] == "messages" and start["data"]["chat_template"] == "chatml"
    assert 0 < start["data"]["target_tokens"] < start["data"]["tokens"]
    losses = [r["loss"] for r in records if "loss" in r and r.get("event") in (None, "step")]
    assert losses and all(loss == loss and loss > 0 for loss in losses)
    # The template the run rendered with travels with the model, so inference renders the same way.
    assert "<|im_start|>" in (out / "final" / "chat_template.jinja").read_text()


def test_memfit_data_json_shows_ids_labels_positions(warm_memfit):
    result = warm_memfit.run("data", "builtin:chat", "--seq-len", "512", "--show", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["format"] == "messages" and report["samples"] > 300 and len(report["shown"]) == 2
    for sample in report["shown"]:
        ids, labels, positions = sample["input_ids"], sample["labels"], sample["position_ids"]
        assert len(ids) == len(labels) == len(positions) and positions == list(range(len(ids)))
        assert all(label in (-100, token) for label, token in zip(labels, ids, strict=True))
        assert 0 < sum(label != -100 for label in labels) < len(ids)
    lengths = report["lengths"]
    assert lengths["p50"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    assert 0 < report["loss_token_share"] < 1
    assert report["length_policy"]["samples_dropped_long"] + report["samples"] == report["records"]
    assert 0 < report["padded_efficiency"] < report["packing_efficiency"] <= 1


def test_memfit_data_marks_loss_tokens_and_train_on_prompt_marks_all(tmp_path, warm_memfit):
    data = jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 3)
    shown = warm_memfit.run("data", data, "--show", "1")
    assert shown.returncode == 0, shown.stderr
    assert "[[2 + 3 = 5.<|im_end|>\n]]" in shown.stdout and "p50" in shown.stdout and "packing efficiency" in shown.stdout
    everything = warm_memfit.run("data", data, "--train-on-prompt", "--json")
    report = json.loads(everything.stdout.strip().splitlines()[-1])
    sample = report["shown"][0]
    assert sample["target_tokens"] == len(sample["input_ids"]) - 1  # all but the first, which nothing predicts


@pytest.mark.parametrize(("records", "extra", "expected"), [
    ([{"messages": [{"role": "user", "content": "hi"}]}], (), "record 1: field 'messages' has no assistant turn"),
    ([{"messages": CHAT}, {"messages": [{"role": "robot", "content": "x"}]}], (), "record 2: field 'messages' turn 1 has unknown role 'robot'"),
    ([{"messages": CHAT}] * 4, ("--seq-len", "8"), "no sample of"),
    ([{"messages": CHAT}, {"prompt": "q"}], (), "record 2 has no field 'messages'"),
    ([{"messages": CHAT}] * 4, ("--model", "{llama}"), "has no chat template"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(records, extra, expected, tmp_path, llama_dir, warm_memfit):
    data = jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "run"
    args = [arg.format(llama=llama_dir) for arg in extra]
    result = warm_memfit.run("train", "--dataset", data, "--batch-size", "1", "--max-steps", "1", "--output-dir", out, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and expected in lines[0], result.stderr
    assert not out.exists()


def test_other_trainers_names_work_in_yaml_and_as_flags(tmp_path):
    config_file = tmp_path / "trl.yaml"
    config_file.write_text("max_length: 128\ndataset_text_field: body\ncompletion_only_loss: false\n")
    config = load_config(config_file)
    assert (config.data.seq_len, config.data.text_field, config.data.train_on) == (128, "body", "all")
    for name, value, train_on in (("assistant_only_loss", "true", "assistant"), ("train_on_inputs", "true", "all"),
                                  ("train-on-inputs", "false", "assistant"), ("train_on_prompt", "true", "all")):
        assert load_config(None, [(name, value)]).data.train_on == train_on
    assert load_config(None, [("train-on", "last")]).data.train_on == "last"


def test_ai_os_chunked_training_becomes_sequence_tiling_and_says_so(tmp_path):
    config_file = tmp_path / "aios.yaml"
    config_file.write_text("use_chunked_training: true\nchunk_size: 256\nmax_seq_length: 1024\n")
    config = load_config(config_file)
    assert config.memory.tiled_mlp == 4 and config.memory.loss_chunk_size == 256
    assert config.memory.gradient_checkpointing == "full"
    assert all("--use-chunked-training at --chunk-size 256" in config.derived[name]
               for name in ("tiled_mlp", "loss_chunk_size", "gradient_checkpointing"))
    # What the user set stays set.
    mine = load_config(config_file, [("gradient-checkpointing", "selective"), ("tiled-mlp", "2")])
    assert mine.memory.gradient_checkpointing == "selective" and mine.memory.tiled_mlp == 2


def test_chunked_training_log_says_what_it_became(tmp_path, llama_dir, text_file, warm_memfit):
    result = warm_memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "64", "--max-steps", "1",
                             "--batch-size", "2", "--use-chunked-training", "--chunk-size", "32",
                             "--output-dir", tmp_path / "run", "--no-report")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "--use-chunked-training at --chunk-size 32" in line]
    assert any("tiled MLP over 2 tiles" in line for line in said), result.stderr
    assert any("chunked loss over 32" in line for line in said), result.stderr


def test_plan_from_the_dataset_lengths(tmp_path, warm_memfit):
    answers = ["ok"] * 50 + ["a longer answer " * 8]
    data = jsonl(tmp_path / "chat.jsonl", [{"messages": [CHAT[0], {"role": "assistant", "content": a}]} for a in answers])
    result = warm_memfit.run("plan", "--model", "tiny", "--memory-budget", "2GiB", "--dataset", data, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    lengths = report["dataset_lengths"]
    assert lengths["samples"] == 51 and lengths["max"] > lengths["p50"]
    # the length memfit train takes from the data: the longest sample, rounded up to a multiple of 64
    assert lengths["seq_len"] == -(-lengths["max"] // 64) * 64 and lengths["basis"] == "the longest sample"
    assert f"--seq-len {lengths['seq_len']}" in report["command"] and f"--dataset {data}" in report["command"]


def test_trl_dataset_type_names_select_the_format():
    assert load_config(None, [("dataset-format", "conversational")]).data.dataset_format == "messages"
    assert load_config(None, [("dataset_format", "language_modeling")]).data.dataset_format == "text"
    assert load_config(None, [("dataset-format", "prompt_completion")]).data.dataset_format == "prompt-completion"

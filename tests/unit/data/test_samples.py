"""The fine-tuning sample dataset: labels from the masks, the length policy and its counts, the cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit.config import DataConfig
from memfit.data import load_training_data
from memfit.data.samples import SFTDataset
from memfit.errors import UsageError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(template: str | None = CHATML):
    from memfit.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.fingerprint = "test-byte"  # not memfit's built-in tokenizer: no chatml stand-in when it lacks a template
    tok.chat_template = template
    return tok


def conversation(answer: str, question: str = "Q?") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rendered_length(tok, record: dict) -> int:
    return len(tok.apply_chat_template(record["messages"], tokenize=True)["input_ids"])


def answer_tokens(answer: str) -> int:
    return len((answer + "<|im_end|>\n").encode())  # bytes: one token each


@pytest.fixture
def records():
    return [conversation("a" * n) for n in (5, 40, 12, 90, 3)]


def test_samples_carry_labels_only_on_answers(tmp_path, records):
    tok = tokenizer()
    data = load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=256,
                                         cache_dir=str(tmp_path / "cache")), tok)
    assert isinstance(data, SFTDataset) and len(data) == 5
    for index, record in enumerate(records):
        sample = data[index]
        ids = tok.apply_chat_template(record["messages"], tokenize=True)["input_ids"]
        assert sample["input_ids"].tolist() == ids
        target = sample["labels"] != -100
        assert torch.equal(sample["labels"][target], sample["input_ids"][target])
        assert int(target.sum()) == answer_tokens(record["messages"][1]["content"])
        assert bool(target[-1]) and not bool(target[0])
    assert data.lengths.tolist() == [rendered_length(tok, r) for r in records]
    assert data.num_target_tokens == sum(answer_tokens(r["messages"][1]["content"]) for r in records)


def test_long_samples_are_dropped_with_allow_drop_with_counts(tmp_path, records):
    tok = tokenizer()
    seq_len = 80
    lengths = [rendered_length(tok, r) for r in records]
    long = [i for i, n in enumerate(lengths) if n > seq_len]
    assert long  # the data has samples to drop (2 of 5: without --allow-drop refused, tests/unit/data/test_length_policy.py)
    data = load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=seq_len,
                                         allow_drop=True, cache_dir=str(tmp_path / "cache")), tok)
    assert len(data) == len(records) - len(long)
    assert data.policy.dropped_long == len(long)
    assert data.policy.target_tokens_lost == sum(answer_tokens(records[i]["messages"][1]["content"]) for i in long)
    assert max(data.lengths) <= seq_len
    assert f"{len(records) - len(long)} of {len(records)} samples of <= {seq_len} tokens" in data.description
    facts = data.data_facts()
    assert facts["samples_dropped_long"] == len(long) and facts["target_tokens_lost"] == data.policy.target_tokens_lost


def test_truncate_cuts_long_samples_and_counts_the_targets_lost(tmp_path, records):
    tok = tokenizer()
    seq_len = 70  # the prompt takes 53 byte tokens: the longer answers are cut, none is cut away entirely
    data = load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=seq_len,
                                         truncate=True, cache_dir=str(tmp_path / "cache")), tok)
    full = [rendered_length(tok, r) for r in records]
    prompt = rendered_length(tok, records[0]) - answer_tokens("a" * 5)  # same question everywhere
    kept_targets = []
    lost = 0
    for record, n in zip(records, full, strict=True):
        targets = answer_tokens(record["messages"][1]["content"])
        left = targets if n <= seq_len else max(0, seq_len - prompt)
        lost += targets - left
        if left:
            kept_targets.append(left)
    assert data.policy.truncated == sum(n > seq_len for n in full)
    assert data.policy.target_tokens_lost == lost
    assert data.num_target_tokens == sum(kept_targets)
    assert all(len(data[i]["input_ids"]) <= seq_len for i in range(len(data)))


def test_empty_after_dropping_is_refused_and_leaves_no_cache(tmp_path, records):
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"no sample of .* is left: 5 of 5 are longer than --seq-len 10.*--truncate") as caught:
        load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=10, cache_dir=str(cache)),
                           tokenizer())
    assert "\n" not in str(caught.value)
    assert not cache.exists()


def test_fewer_samples_than_one_batch_is_refused(tmp_path, records):
    with pytest.raises(UsageError, match="fewer than one effective batch"):
        load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=256,
                                      cache_dir=str(tmp_path / "c")), tokenizer(), min_samples=6)


def test_a_bad_record_stops_before_anything_is_written(tmp_path, records):
    bad = records[:2] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"record 3: field 'messages' has no assistant turn"):
        load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", bad)), cache_dir=str(cache)), tokenizer())
    assert not cache.exists()


def test_tokenizer_without_template_is_refused_and_chat_template_flag_fixes_it(tmp_path, records):
    path = str(write(tmp_path / "d.jsonl", records))
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match="has no chat template.*--chat-template"):
        load_training_data(DataConfig(dataset=path, cache_dir=str(cache)), tokenizer(template=None))
    assert not cache.exists()
    tok = tokenizer(template=None)
    data = load_training_data(DataConfig(dataset=path, cache_dir=str(cache), chat_template="llama3"), tok)
    assert len(data) == 5 and "<|start_header_id|>" in tok.chat_template  # saved with the model, used at inference
    assert data[0]["input_ids"].tolist() == tok.apply_chat_template(records[0]["messages"], tokenize=True)["input_ids"]


def test_builtin_tokenizer_renders_with_chatml_visibly(tmp_path, caplog):
    from memfit.models.tiny import byte_tokenizer

    with caplog.at_level("WARNING"):
        data = load_training_data(DataConfig(dataset="builtin:chat", seq_len=1024, cache_dir=str(tmp_path / "c")),
                                  byte_tokenizer())
    assert "built-in byte tokenizer has none" in caplog.text and data.template_name == "chatml"
    assert len(data) >= 300 and 0 < data.num_target_tokens < data.num_tokens


def test_second_load_reads_the_cache_and_options_change_the_key(tmp_path, records):
    path = str(write(tmp_path / "d.jsonl", records))
    cfg = DataConfig(dataset=path, seq_len=256, cache_dir=str(tmp_path / "cache"))
    first = load_training_data(cfg, tokenizer())
    again = load_training_data(cfg, tokenizer())
    assert not first.from_cache and again.from_cache
    assert [again[i]["labels"].tolist() for i in range(5)] == [first[i]["labels"].tolist() for i in range(5)]
    shorter = load_training_data(DataConfig(dataset=path, seq_len=80, allow_drop=True, cache_dir=cfg.cache_dir),
                                 tokenizer())
    assert shorter.from_cache  # the length policy applies on load: no new tokenization
    everything = load_training_data(DataConfig(dataset=path, seq_len=256, train_on="all", cache_dir=cfg.cache_dir),
                                    tokenizer())
    assert not everything.from_cache
    assert all(bool((everything[i]["labels"][1:] != -100).all()) for i in range(5))


def test_samples_pack_without_crossing(tmp_path, records):
    from memfit.data.packing import PackedDataset

    data = load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), seq_len=256,
                                         cache_dir=str(tmp_path / "cache")), tokenizer())
    packed = PackedDataset(data, 256)
    rows = [packed[i] for i in range(len(packed))]
    assert sum(len(r["input_ids"]) for r in rows) == int(np.sum(data.lengths))
    assert sum(int((r["labels"] != -100).sum()) for r in rows) == data.num_target_tokens


def test_alpaca_and_sharegpt_files_train_on_their_answers(tmp_path):
    alpaca = write(tmp_path / "a.jsonl", [{"instruction": "Add.", "input": "1 2", "output": "3"}] * 2)
    sharegpt = write(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "hello"}]}] * 2)
    for path, answer in ((alpaca, "3"), (sharegpt, "hello")):
        tok = tokenizer()
        data = load_training_data(DataConfig(dataset=str(path), cache_dir=str(tmp_path / "c")), tok)
        sample = data[0]
        target = sample["labels"] != -100
        assert tok.decode(sample["input_ids"][target].tolist()) == answer + "<|im_end|>\n"


def test_wrapped_packing_is_refused_for_conversations_before_any_write(tmp_path, records):
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match="--packing wrapped .* would cut conversations"):
        load_training_data(DataConfig(dataset=str(write(tmp_path / "d.jsonl", records)), packing="wrapped",
                                      cache_dir=str(cache)), tokenizer())
    assert not cache.exists()

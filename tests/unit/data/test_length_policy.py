"""--seq-len from the data for whole samples, and a length that drops too much refused (memfit.data.lengths).

A chat set of 50 multi-turn conversations of varied length, most of them longer than 256 byte tokens: the old default
(--seq-len 256) silently dropped more than half of it. Without --seq-len the length now comes from the data and keeps
every sample; a length that drops more than 1% of the samples or target tokens stops before anything is written, in
one line naming --seq-len N, --truncate and --allow-drop; plain text keeps windows of 256.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from memfit.config import DataConfig
from memfit.data import load_training_data
from memfit.data.lengths import length_keeping, seq_len_from_data
from memfit.data.tables import label_spec, load_table
from memfit.errors import UsageError
from tiny_encoders import dna_rows, dna_tokenizer, write_csv

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "the of a memory model train token sample answer question long short GPU batch data loss".split()


def tokenizer():
    from memfit.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.fingerprint = "test-byte-seq-len"
    tok.chat_template = CHATML
    return tok


def chat_set(count: int = 50, seed: int = 3) -> list[dict]:
    """Multi-turn conversations of varied length (about 100 to 700 byte tokens)."""
    rng = random.Random(seed)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."

    records = []
    for _ in range(count):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": sentence(2, 10)}, {"role": "assistant", "content": sentence(3, 30)}]
        records.append({"messages": turns})
    return records


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def whole(path: Path, cache: Path):
    """Every sample whole (no length policy): lengths, target tokens per sample, labels."""
    data = load_training_data(DataConfig(dataset=str(path), seq_len=1 << 20, cache_dir=str(cache)), tokenizer(), say=False)
    assert len(data) == data.num_documents
    return data


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit: ")]


@pytest.fixture
def chats(tmp_path):
    return write(tmp_path / "chats.jsonl", chat_set())


def test_without_seq_len_the_length_comes_from_the_data_and_keeps_every_sample(chats, tmp_path, caplog):
    full = whole(chats, tmp_path / "whole")
    longest = int(full.lengths.max())
    assert (full.lengths > 256).sum() > 25  # the old default would have dropped more than half
    caplog.set_level(logging.INFO)
    data = load_training_data(DataConfig(dataset=str(chats), cache_dir=str(tmp_path / "cache")), tokenizer())
    assert data.seq_len == -(-longest // 64) * 64  # the longest sample, rounded up to a multiple of 64
    assert len(data) == 50 and data.policy.dropped_long == 0 and data.policy.target_tokens_lost == 0
    assert data.num_target_tokens == full.num_target_tokens
    lines = [line for line in said(caplog) if "from the data" in line]
    assert lines == [f"memfit: seq-len {data.seq_len} from the data (longest sample {longest} tokens; keeps 50 of 50"
                     " samples)"]
    assert data.data_facts()["seq_len_from_data"] is True


def test_the_models_positions_cap_the_length_and_what_that_drops_is_refused(chats, tmp_path):
    with pytest.raises(UsageError) as caught:
        load_training_data(DataConfig(dataset=str(chats), cache_dir=str(tmp_path / "cache")), tokenizer(),
                           max_positions=300)
    message = str(caught.value)
    assert message.startswith("seq-len 300 (from the data) would drop") and "\n" not in message
    assert "the model handles at most 300 positions" in message and "--truncate" in message and "--allow-drop" in message
    assert not (tmp_path / "cache").exists()
    capped = load_training_data(DataConfig(dataset=str(chats), truncate=True, cache_dir=str(tmp_path / "cache")),
                                tokenizer(), max_positions=300)
    assert capped.seq_len == 300 and len(capped) == 50


def test_a_length_that_drops_over_one_percent_is_refused_in_one_line_with_what_to_change(chats, tmp_path):
    full = whole(chats, tmp_path / "whole")
    long = full.lengths > 256
    lost = int(full.policy.targets[long].sum())
    cache = tmp_path / "cache"
    with pytest.raises(UsageError) as caught:
        load_training_data(DataConfig(dataset=str(chats), seq_len=256, cache_dir=str(cache)), tokenizer())
    message = str(caught.value)
    assert "\n" not in message
    assert f"--seq-len 256 would drop {int(long.sum())} of 50 samples of {chats}" in message
    assert f"{lost:,} of {full.num_target_tokens:,} target tokens" in message
    keep = -(-int(full.lengths.max()) // 64) * 64
    assert f"pass --seq-len {keep} to keep them, --truncate to cut them" in message and "--allow-drop" in message
    assert not cache.exists()  # refused before the token cache is written


def test_allow_drop_trains_without_them_and_says_so_in_one_short_line(chats, tmp_path, caplog):
    full = whole(chats, tmp_path / "whole")
    long = full.lengths > 256
    caplog.set_level(logging.INFO)
    data = load_training_data(DataConfig(dataset=str(chats), seq_len=256, allow_drop=True,
                                         cache_dir=str(tmp_path / "cache")), tokenizer())
    assert len(data) == 50 - int(long.sum()) and data.policy.dropped_long == int(long.sum())
    assert data.policy.target_tokens_lost == int(full.policy.targets[long].sum())
    lines = [line for line in said(caplog) if "drops" in line]
    assert len(lines) == 1 and lines[0].startswith(f"memfit: --allow-drop: --seq-len 256 drops {int(long.sum())} of 50")
    assert "longer than" not in data.description  # said apart, not buried in the long data line


def test_truncate_keeps_every_sample_cut_to_its_start_and_counts_the_target_tokens_cut(chats, tmp_path, caplog):
    full = whole(chats, tmp_path / "whole")
    cut = sum(int((full[i]["labels"][256:] != -100).sum()) for i in range(len(full)))
    assert cut > 0
    caplog.set_level(logging.INFO)
    data = load_training_data(DataConfig(dataset=str(chats), seq_len=256, truncate=True,
                                         cache_dir=str(tmp_path / "cache")), tokenizer())
    assert len(data) == 50 and data.policy.truncated == int((full.lengths > 256).sum())
    assert data.policy.target_tokens_lost == cut
    for i in range(len(data)):  # each sample is its own start
        n = len(data[i]["input_ids"])
        assert n <= 256 and data[i]["input_ids"].tolist() == full[i]["input_ids"][:n].tolist()
    lines = [line for line in said(caplog) if "--truncate" in line]
    assert len(lines) == 1 and f"{cut:,} of {full.num_target_tokens:,} target tokens cut" in lines[0]


def test_a_small_drop_is_said_in_one_short_line_and_trains(tmp_path, caplog):
    records = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."}]}] * 199
    records.append({"messages": [{"role": "user", "content": "long question " * 30}, {"role": "assistant", "content": "Ok."}]})
    path = write(tmp_path / "few.jsonl", records)
    caplog.set_level(logging.INFO)
    data = load_training_data(DataConfig(dataset=str(path), seq_len=256, cache_dir=str(tmp_path / "cache")), tokenizer())
    assert len(data) == 199 and data.policy.dropped_long == 1
    lines = [line for line in said(caplog) if "drops" in line]
    assert len(lines) == 1 and lines[0].startswith("memfit: --seq-len 256 drops 1 of 200 samples")
    assert lines[0].endswith("keeps them") and len(lines[0]) < 240


def test_the_length_from_the_data_rounds_up_keeps_99_percent_past_far_outliers_and_fits_the_positions():
    assert seq_len_from_data(np.array([731, 200, 64]), np.array([100, 10, 5])).seq_len == 768
    lengths = np.array([100] * 199 + [5000])
    targets = np.array([10] * 199 + [1])
    assert length_keeping(lengths, targets) == 100
    choice = seq_len_from_data(lengths, targets)
    assert (choice.seq_len, choice.kept, choice.longest) == (128, 199, 5000)
    # an outlier holding more than 1% of the target tokens is kept: the longest sets the length
    assert seq_len_from_data(lengths, np.array([10] * 199 + [500])).seq_len == 5056
    capped = seq_len_from_data(np.array([731, 200]), np.array([5, 5]), max_positions=512)
    assert (capped.seq_len, capped.kept, capped.max_positions) == (512, 1, 512)


def test_plain_text_keeps_windows_of_256(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join("word " * 200 for _ in range(20)))
    data = load_training_data(DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache")), tokenizer())
    assert data.seq_len == 256 and int(np.max(data.lengths)) == 256
    fewer = load_training_data(DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache")), tokenizer(),
                               max_positions=128)
    assert fewer.seq_len == 128


def test_a_table_takes_its_length_from_its_rows_and_refuses_a_length_that_drops_them(tmp_path):
    path = write_csv(tmp_path / "t.csv", dna_rows(40, min_length=8, max_length=120))
    spec = label_spec(str(path), "class", ["label"], "sequence", None, None)
    table = load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=None, truncate=False)
    longest = 120 + 2  # [CLS] and [SEP] around the longest sequence at most
    assert len(table) == 40 and table.seq_len == 128 and int(table.lengths.max()) <= longest
    with pytest.raises(UsageError, match=r"--seq-len 64 would drop \d+ of 40 samples .*--seq-len 128 to keep them"):
        load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=64, truncate=False)
    allowed = load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=64, truncate=False,
                         allow_drop=True)
    assert 0 < len(allowed) < 40

"""load_training_data: the public entry point, end to end on files and the bundled corpus."""

from __future__ import annotations

import pytest
import torch

from memfit.config import DataConfig
from memfit.data import BatchSchedule, collate, load_training_data, target_token_count
from memfit.errors import UsageError


@pytest.fixture
def long_text(tmp_path):
    path = tmp_path / "long.txt"
    paragraphs = [f"Paragraph {i} tells a short story about the number {i * 7}." for i in range(40)]
    path.write_text("\n\n".join(paragraphs))
    return path


def test_samples_are_windows_with_labels(long_text, tmp_path, byte_tokenizer):
    cfg = DataConfig(dataset=str(long_text), seq_len=64, stride=8, cache_dir=str(tmp_path / "cache"))
    dataset = load_training_data(cfg, byte_tokenizer, max_positions=128)
    assert dataset.num_documents == 40
    assert dataset.num_tokens == len(long_text.read_text().replace("\n\n", "")) + 40
    assert dataset.num_target_tokens == dataset.num_tokens - 1
    first, second = dataset[0], dataset[1]
    assert first["input_ids"].dtype == torch.long and first["input_ids"].shape == (64,)
    assert torch.equal(first["labels"], first["input_ids"])
    assert (second["labels"][:8] == -100).all() and torch.equal(second["labels"][8:], second["input_ids"][8:])
    assert torch.equal(second["input_ids"][:8], first["input_ids"][-8:])
    assert dataset[-1]["input_ids"].shape == (64,)
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    assert "tokenized now" in dataset.description
    again = load_training_data(cfg, byte_tokenizer)
    assert "from cache" in again.description and "40 documents" in again.description
    assert byte_tokenizer.encode_calls == 40  # the second load did not tokenize


def test_no_packing_gives_one_padded_document_per_sample(long_text, tmp_path, byte_tokenizer):
    cfg = DataConfig(dataset=str(long_text), seq_len=128, packing=False, cache_dir=str(tmp_path / "cache"))
    dataset = load_training_data(cfg, byte_tokenizer)
    assert len(dataset) == 40
    eos = byte_tokenizer.eos_token_id
    assert all(dataset[i]["input_ids"][-1] == eos for i in range(len(dataset)))
    batch = collate([dataset[i] for i in range(4)], byte_tokenizer.pad_token_id)
    padding = batch["attention_mask"] == 0
    assert padding.any()
    assert (batch["labels"][padding] == -100).all()
    assert int((batch["labels"][:, 1:] != -100).sum()) == target_token_count([dataset[i] for i in range(4)])


def test_a_full_pass_trains_each_token_once(long_text, tmp_path, byte_tokenizer):
    cfg = DataConfig(dataset=str(long_text), seq_len=50, stride=5, cache_dir=str(tmp_path / "cache"))
    dataset = load_training_data(cfg, byte_tokenizer)
    schedule = BatchSchedule(len(dataset), effective_batch_size=len(dataset), seed=0)
    samples = [dataset[i] for i in schedule.batch_indices(0)]
    assert target_token_count(samples) == dataset.num_tokens - 1


def test_real_tokenizer_end_to_end(tmp_path, word_tokenizer):
    path = tmp_path / "story.jsonl"
    path.write_text("".join('{"text": "the cat sat on the mat . the dog ran far away ."}\n' for _ in range(20)))
    cfg = DataConfig(dataset=str(path), seq_len=16, cache_dir=str(tmp_path / "cache"))
    dataset = load_training_data(cfg, word_tokenizer)
    assert dataset.num_tokens == 20 * 14
    batch = collate([dataset[i] for i in range(3)], word_tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (3, 16)
    assert word_tokenizer.eos_token_id in batch["input_ids"].tolist()[0] + batch["input_ids"].tolist()[1]


def test_seq_len_longer_than_the_model_is_refused(long_text, tmp_path, byte_tokenizer):
    cfg = DataConfig(dataset=str(long_text), seq_len=1024, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="handles at most 512 positions; lower --seq-len"):
        load_training_data(cfg, byte_tokenizer, max_positions=512)


def test_too_little_text_for_one_window_is_refused(tmp_path, byte_tokenizer):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words")
    cfg = DataConfig(dataset=str(path), seq_len=256, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="fewer than one window"):
        load_training_data(cfg, byte_tokenizer)
    assert not (tmp_path / "cache").exists()


def test_fewer_windows_than_one_effective_batch_is_refused_before_caching(long_text, tmp_path, byte_tokenizer):
    cfg = DataConfig(dataset=str(long_text), seq_len=64, cache_dir=str(tmp_path / "cache"))
    windows = len(load_training_data(cfg, byte_tokenizer, min_samples=1))
    fresh = DataConfig(dataset=str(long_text), seq_len=64, cache_dir=str(tmp_path / "other"))
    with pytest.raises(UsageError, match=f"has {windows} samples of 64 tokens, fewer than one effective batch"):
        load_training_data(fresh, byte_tokenizer, min_samples=windows + 1)
    assert not (tmp_path / "other").exists()
    assert len(load_training_data(fresh, byte_tokenizer, min_samples=windows)) == windows


def test_the_bundled_corpus_is_the_default(tmp_path, byte_tokenizer):
    dataset = load_training_data(DataConfig(cache_dir=str(tmp_path / "cache")), byte_tokenizer)
    assert dataset.description.startswith("bundled corpus:")
    assert len(dataset) > 100

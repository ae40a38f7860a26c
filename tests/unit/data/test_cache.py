"""Token cache: tokenize once, reuse on the next run, never leave a half cache."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.data.cache import cache_key, load_or_tokenize, token_dtype, tokenizer_fingerprint
from memfit.data.sources import resolve_source
from memfit.errors import UsageError

TEXT = "hello world\n\nsecond document\nwith two lines\n\nthird\n"


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text(TEXT)
    return path


def test_tokens_are_documents_each_followed_by_eos(text_file, tmp_path, byte_tokenizer):
    store = load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, tmp_path / "cache")
    assert not store.from_cache
    assert store.num_documents == 3
    docs = ["hello world", "second document\nwith two lines", "third"]
    expected = [t for doc in docs for t in [*doc.encode(), 256]]
    assert store.tokens.tolist() == expected
    assert store.doc_offsets.tolist() == [0, 12, 43, 49]
    assert store.tokens.dtype == np.uint16


def test_second_run_reads_the_cache_without_tokenizing(text_file, tmp_path, byte_tokenizer_class):
    first_tokenizer, second_tokenizer = byte_tokenizer_class(), byte_tokenizer_class()
    first = load_or_tokenize(resolve_source(str(text_file)), first_tokenizer, tmp_path / "cache")
    second = load_or_tokenize(resolve_source(str(text_file)), second_tokenizer, tmp_path / "cache")
    assert first_tokenizer.encode_calls == 3
    assert second_tokenizer.encode_calls == 0
    assert second.from_cache
    assert isinstance(second.tokens, np.memmap)
    assert second.tokens.tolist() == first.tokens.tolist()


def test_editing_the_file_or_changing_the_tokenizer_tokenizes_again(
    text_file, tmp_path, word_tokenizer, byte_tokenizer_class
):
    ByteTokenizer = byte_tokenizer_class
    cache = tmp_path / "cache"
    load_or_tokenize(resolve_source(str(text_file)), ByteTokenizer(), cache)
    text_file.write_text(TEXT + "\nfourth\n")
    again = ByteTokenizer()
    assert load_or_tokenize(resolve_source(str(text_file)), again, cache).num_documents == 4
    assert again.encode_calls == 4
    other = load_or_tokenize(resolve_source(str(text_file)), word_tokenizer, cache)
    assert not other.from_cache
    assert len(list(cache.iterdir())) == 3


def test_hf_tokenizer_is_tokenized_without_special_tokens_and_cached(tmp_path, word_tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "the cat sat on the mat ."}\n{"text": "a dog ran far away"}\n')
    source = resolve_source(str(path))
    store = load_or_tokenize(source, word_tokenizer, tmp_path / "cache")
    eos = word_tokenizer.eos_token_id
    assert store.tokens.tolist() == [3, 5, 7, 8, 3, 9, 16, eos, 4, 6, 10, 11, 12, eos]
    assert load_or_tokenize(source, word_tokenizer, tmp_path / "cache").from_cache


def test_fingerprint_uses_the_tokenizers_own_when_present(byte_tokenizer, word_tokenizer, byte_tokenizer_class):
    ByteTokenizer = byte_tokenizer_class

    class Named(ByteTokenizer):
        fingerprint = "byte-v1"

    assert tokenizer_fingerprint(Named()) == "byte-v1"
    assert tokenizer_fingerprint(byte_tokenizer) == tokenizer_fingerprint(ByteTokenizer())
    assert tokenizer_fingerprint(byte_tokenizer) != tokenizer_fingerprint(word_tokenizer)


def test_text_field_is_part_of_the_key_for_jsonl(tmp_path, byte_tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a", "body": "b"}\n')
    key_text, _ = cache_key(resolve_source(str(path), "text"), byte_tokenizer)
    key_body, _ = cache_key(resolve_source(str(path), "body"), byte_tokenizer)
    assert key_text != key_body


def test_a_failed_run_leaves_no_cache(text_file, tmp_path, byte_tokenizer_class):
    ByteTokenizer = byte_tokenizer_class

    class Failing(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            if self.encode_calls == 2:
                raise KeyboardInterrupt  # as if the run were killed mid-way
            return super().encode(text, add_special_tokens)

    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load_or_tokenize(resolve_source(str(text_file)), Failing(), cache)
    assert not cache.exists()
    cache.mkdir()  # an existing cache directory is left as it was, too
    with pytest.raises(KeyboardInterrupt):
        load_or_tokenize(resolve_source(str(text_file)), Failing(), cache)
    assert list(cache.iterdir()) == []
    assert not load_or_tokenize(resolve_source(str(text_file)), ByteTokenizer(), cache).from_cache


def test_empty_dataset_is_a_usage_error_and_is_not_cached(tmp_path, byte_tokenizer):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n   \n")
    with pytest.raises(UsageError, match="holds no text"):
        load_or_tokenize(resolve_source(str(path)), byte_tokenizer, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_data_the_check_rejects_leaves_no_cache(text_file, tmp_path, byte_tokenizer):
    """The caller's check sees the tokens before the cache (or its directory) is written."""
    cache = tmp_path / "out" / "cache"
    seen = []

    def reject(store):
        seen.append(store.num_documents)
        raise UsageError("not enough")

    with pytest.raises(UsageError, match="not enough"):
        load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, cache, check=reject)
    assert seen == [3] and not (tmp_path / "out").exists()

    store = load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, cache, check=seen.append)
    assert not store.from_cache and [path.name for path in cache.iterdir()] == [store.key]
    with pytest.raises(UsageError, match="not enough"):  # a cached copy is checked as well
        load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, cache, check=reject)
    assert [path.name for path in cache.iterdir()] == [store.key]


def test_quick_tokenizing_logs_nothing(text_file, tmp_path, byte_tokenizer, caplog, monkeypatch):
    """A bad-input run prints its one error line only; tokenizing speaks up once it takes a while."""
    import memfit.data.cache as cache_module

    with caplog.at_level("INFO", logger="memfit.data.cache"):
        load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, tmp_path / "quick")
        assert caplog.messages == []
        monkeypatch.setattr(cache_module, "ANNOUNCE_AFTER_SECONDS", -1.0)
        load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, tmp_path / "slow")
    assert len(caplog.messages) == 1 and "tokenizing" in caplog.messages[0]


def test_tokenizer_without_eos_is_a_usage_error(text_file, tmp_path, byte_tokenizer_class):
    class NoEos(byte_tokenizer_class):
        eos_token_id = None

    with pytest.raises(UsageError, match="no end-of-text"):
        load_or_tokenize(resolve_source(str(text_file)), NoEos(), tmp_path / "cache")


def test_unwritable_cache_dir_names_the_flag(text_file, tmp_path, byte_tokenizer):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UsageError, match="--cache-dir"):
        load_or_tokenize(resolve_source(str(text_file)), byte_tokenizer, blocker / "cache")


def test_token_dtype_follows_the_vocabulary_size():
    assert token_dtype(50_257) == np.uint16
    assert token_dtype(65_535) == np.uint16
    assert token_dtype(65_536) == np.uint32
    assert token_dtype(128_256) == np.uint32

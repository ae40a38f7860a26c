"""Tokenizers for the data tests: a byte-level stub and a real Hugging Face tokenizer built offline."""

from __future__ import annotations

import pytest


class ByteTokenizer:
    """One token per UTF-8 byte; 256 is EOS, 257 is padding. Counts its encode calls."""

    eos_token_id = 256
    pad_token_id = 257

    def __init__(self) -> None:
        self.encode_calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_calls += 1
        return list(text.encode("utf-8"))

    def get_vocab(self) -> dict[str, int]:
        vocab = {f"<{i}>": i for i in range(256)}
        vocab.update({"<eos>": 256, "<pad>": 257})
        return vocab

    def __len__(self) -> int:
        return 258


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def word_tokenizer():
    """A Hugging Face fast tokenizer with a word-level vocabulary, built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog sat on mat ran far away and then slept . ,".split()
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2} | {word: i + 3 for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


@pytest.fixture
def byte_tokenizer_class() -> type[ByteTokenizer]:
    """The stub class itself, for tests that need several instances or a subclass."""
    return ByteTokenizer

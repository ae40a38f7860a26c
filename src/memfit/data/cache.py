"""Tokenize a source once and keep the tokens on disk, so the next run starts at once.

The cache holds, per (tokenizer, source content, format options), one directory:

    <cache_dir>/<key>/tokens.bin     every token, documents back to back, each followed by EOS
                                     (uint16 when the vocabulary has fewer than 65,536 entries, else uint32)
    <cache_dir>/<key>/offsets.npy    int64 start of each document in tokens.bin, plus the end
    <cache_dir>/<key>/index.json     what was tokenized, with what, and the counts

Fresh tokens are written to a temporary directory inside the cache directory and checked
(by the caller's `check`, e.g. "enough text for one batch") before they are renamed into
place; data that fails the check leaves nothing behind, not even the directories that were
made for it. The rename is atomic: a run killed while tokenizing leaves no half cache, and
two processes tokenizing the same data at once both end up reading one complete copy.
Tokens are read back as a numpy memmap: opening a cache costs no memory and no time,
whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.data.sources import TextSource
from memfit.errors import UsageError

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the layout or the tokenization rules change
ENCODE_BATCH = 256  # documents per tokenizer call: large enough for fast tokenizers to parallelize
ANNOUNCE_AFTER_SECONDS = 2.0
"""Tokenizing says so on the log only once it has taken this long (a quick one, or bad data, stays silent)."""


@dataclass
class TokenStore:
    """Tokens of a whole source: one flat array and where each document starts."""

    tokens: np.ndarray
    """All tokens, documents back to back, each ending with EOS (a read-only memmap when cached)."""
    doc_offsets: np.ndarray
    """int64, length num_documents + 1: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]."""
    from_cache: bool
    """True when read from an earlier run's cache, False when tokenized now."""
    key: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "memfit" / "tokens"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hex id of what a tokenizer does, so a different tokenizer never reuses tokens.

    Uses the tokenizer's own `fingerprint` (attribute or method) when it has one; otherwise
    hashes its class name, sorted vocabulary, EOS id and, for Hugging Face fast tokenizers,
    the full pipeline description (normalizer, pre-tokenizer, merges).
    """
    own = getattr(tokenizer, "fingerprint", None)
    if callable(own):
        own = own()
    if own:
        return str(own)
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    vocab = tokenizer.get_vocab()
    for token, index in sorted(vocab.items(), key=lambda item: (item[1], str(item[0]))):
        digest.update(f"{token!r}\x00{index}\x01".encode())
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    return digest.hexdigest()


def vocab_size(tokenizer: Any) -> int:
    """Upper bound of the token ids the tokenizer can produce."""
    sizes = [int(tokenizer.eos_token_id or 0) + 1]
    for probe in (lambda: len(tokenizer), lambda: tokenizer.vocab_size, lambda: len(tokenizer.get_vocab())):
        try:
            sizes.append(int(probe()))
        except (TypeError, AttributeError):
            continue
    return max(sizes)


def token_dtype(size: int) -> np.dtype:
    return np.dtype(np.uint16) if size < 2**16 else np.dtype(np.uint32)


def cache_key(source: TextSource, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """(hex key, what it was computed from) for a source and a tokenizer."""
    parts: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": source.identity(),
    }
    if source.kind != "txt":
        parts["text_field"] = source.text_field
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32], parts


def load_or_tokenize(
    source: TextSource,
    tokenizer: Any,
    cache_dir: str | Path | None = None,
    check: Callable[[TokenStore], None] | None = None,
) -> TokenStore:
    """Tokens of `source`: from the cache when this exact data and tokenizer were seen before,
    else tokenized now (each document followed by EOS) and cached for the next run.

    `check(store)` runs on the tokens (cached or fresh) before they are put in the cache;
    it raises to reject the data, and then nothing is left behind (no cache entry, and no
    directory that was made for it).

    Raises UsageError when the source holds no text, the tokenizer has no EOS token,
    the cache directory cannot be written, or `check` rejects the data.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError(
            "the tokenizer has no end-of-text (EOS) token to separate documents; use a tokenizer that has one"
        )
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key, parts = cache_key(source, tokenizer)
    final = root / key
    if (final / "index.json").is_file():
        store = open_store(final, key)
        if check is not None:
            check(store)
        return store

    try:
        created = _make_directories(root)
    except OSError as error:
        raise UsageError(f"cannot write the token cache in {root} ({error.strerror}); pass --cache-dir DIR") from None
    published, tmp = False, None
    try:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        except OSError as error:
            raise UsageError(f"cannot write the token cache in {root} ({error.strerror}); pass --cache-dir DIR") from None
        write_tokens(tmp, source.documents(), tokenizer, source.label, parts, announce=f"cache in {root}")
        if check is not None:
            check(open_store(tmp, key))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same cache first: keep theirs.
            if not (final / "index.json").is_file():
                raise
        published = True
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not published:  # rejected or interrupted: leave the file system as it was
            for directory in reversed(created):
                try:
                    directory.rmdir()
                except OSError:  # no longer empty: someone else uses it now
                    break
    store = open_store(final, key)
    store.from_cache = False
    return store


def _make_directories(root: Path) -> list[Path]:
    """Create `root` and its missing parents; return the ones created, outermost first."""
    missing = []
    directory = root
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    root.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def write_tokens(
    directory: Path, documents: Iterable[str], tokenizer: Any, label: str, parts: dict[str, Any], announce: str = ""
) -> None:
    """Tokenize `documents` into `directory` (tokens.bin, offsets.npy, then index.json last).

    Once tokenizing has taken ANNOUNCE_AFTER_SECONDS, one log line says what is being tokenized
    (`announce` says where it goes).
    """
    eos = int(tokenizer.eos_token_id)
    size = vocab_size(tokenizer)
    dtype = token_dtype(size)
    limit = np.iinfo(dtype).max
    offsets = [0]
    started, announced = time.monotonic(), False
    with (directory / "tokens.bin").open("wb") as handle:
        for batch in _batches(documents, ENCODE_BATCH):
            if not announced and time.monotonic() - started > ANNOUNCE_AFTER_SECONDS:
                logger.info("tokenizing %s once (%s)", label, announce or f"in {directory}")
                announced = True
            for ids in encode_batch(tokenizer, batch):
                if not ids:
                    continue
                array = np.asarray(list(ids) + [eos], dtype=np.int64)
                if array.max() > limit or array.min() < 0:
                    raise UsageError(
                        f"the tokenizer produced id {int(array.max())}, outside its vocabulary of {size}; check the tokenizer"
                    )
                array.astype(dtype).tofile(handle)
                offsets.append(offsets[-1] + len(array))
    if len(offsets) == 1:
        raise UsageError(f"{label} holds no text; give a dataset with at least one non-empty document")
    np.save(directory / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    index = {
        "source": label,
        "key_parts": parts,
        "dtype": dtype.name,
        "num_tokens": offsets[-1],
        "num_documents": len(offsets) - 1,
        "eos_token_id": eos,
    }
    # Written last: a directory without index.json is never read.
    (directory / "index.json").write_text(json.dumps(index, indent=1))


def open_store(directory: Path, key: str = "") -> TokenStore:
    """Open a complete cache directory as a TokenStore (tokens memory-mapped, read-only)."""
    index = json.loads((directory / "index.json").read_text())
    offsets = np.load(directory / "offsets.npy")
    tokens = np.memmap(directory / "tokens.bin", dtype=np.dtype(index["dtype"]), mode="r", shape=(index["num_tokens"],))
    return TokenStore(tokens=tokens, doc_offsets=offsets, from_cache=True, key=key)


def encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (EOS is added by the caller)."""
    if getattr(tokenizer, "is_fast", False) and callable(tokenizer):
        # One call per batch lets a Rust tokenizer use every core; verbose=False silences
        # the warning about documents longer than the model (windows cut them later).
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False, return_attention_mask=False)
        return list(encoded["input_ids"])
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

"""Where training text comes from: files and Hugging Face datasets, read as documents.

A source is named by the `--dataset` value:

- `path/to/file.txt`: plain text; documents are separated by one or more blank lines.
- `path/to/file.jsonl`: one JSON object per line; the text is in `--text-field` (default `text`).
- `path/to/file.parquet`: a column named `--text-field` (needs pyarrow).
- `hf:NAME[:CONFIG][@SPLIT]`: a Hugging Face dataset (needs the `datasets` package and,
  the first time, the network); the split defaults to `train`.
- nothing: the corpus bundled with memfit.

Every reader yields documents as strings, lazily, so a large file is never held in
memory twice. `TextSource.identity()` says what the token cache is keyed by: the
sha256 of the file's bytes (so an edited file is tokenized again), or the name,
config and split of a Hugging Face dataset.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from memfit.errors import UsageError

HF_PREFIX = "hf:"
FILE_FORMATS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


def bundled_corpus_path() -> Path:
    """The small English corpus shipped with memfit (the default training text)."""
    return Path(str(resources.files("memfit.data").joinpath("corpus", "corpus.txt")))


@dataclass(frozen=True)
class TextSource:
    """A resolved training-text source: a local file of a known format, or a Hugging Face dataset."""

    kind: str
    """'txt', 'jsonl', 'parquet' or 'hf'."""
    location: str
    """File path, or the Hugging Face dataset name."""
    text_field: str = "text"
    hf_config: str | None = None
    hf_split: str = "train"
    label: str = ""
    """How the source is named to the user."""

    def identity(self) -> dict[str, str | None]:
        """What identifies this source's content, for the token cache key."""
        if self.kind == "hf":
            return {"kind": "hf", "name": self.location, "config": self.hf_config, "split": self.hf_split}
        return {"kind": self.kind, "sha256": file_sha256(Path(self.location))}

    def documents(self) -> Iterator[str]:
        """Yield the non-empty documents of the source, in file order."""
        if self.kind == "hf":
            yield from read_hf(self.location, self.hf_config, self.hf_split, self.text_field)
        elif self.kind == "txt":
            yield from read_txt(Path(self.location))
        elif self.kind == "jsonl":
            yield from read_jsonl(Path(self.location), self.text_field)
        else:
            yield from read_parquet(Path(self.location), self.text_field)


def resolve_source(dataset: str | None, text_field: str = "text") -> TextSource:
    """Turn a `--dataset` value into a TextSource; raise UsageError if it cannot be read.

    Checks what can be checked without reading the data: the file exists and its
    extension is one memfit reads.
    """
    if dataset is None or dataset.strip() in ("", "bundled", "default"):
        path = bundled_corpus_path()
        if not path.is_file():
            raise UsageError(f"the bundled corpus is missing at {path}; reinstall memfit or pass --dataset FILE")
        return TextSource("txt", str(path), text_field, label="bundled corpus")
    dataset = dataset.strip()
    if dataset.startswith(HF_PREFIX):
        return _parse_hf(dataset, text_field)
    path = Path(dataset).expanduser()
    if not path.exists():
        raise UsageError(f"dataset file {dataset} does not exist; check the path given to --dataset")
    if path.is_dir():
        raise UsageError(f"--dataset {dataset} is a directory; give a .txt, .jsonl or .parquet file inside it")
    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UsageError(
            f"--dataset {dataset}: unsupported file type {path.suffix or '(none)'!r};"
            " use a .txt, .jsonl or .parquet file, or hf:NAME for a Hugging Face dataset"
        )
    return TextSource(kind, str(path), text_field, label=str(path))


def _parse_hf(dataset: str, text_field: str) -> TextSource:
    spec = dataset[len(HF_PREFIX) :]
    spec, _, split = spec.partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise UsageError(
            f"--dataset {dataset}: name the dataset, as hf:NAME[:CONFIG][@SPLIT] (e.g. hf:wikitext:wikitext-2-raw-v1@train)"
        )
    return TextSource("hf", name, text_field, hf_config=config or None, hf_split=split or "train", label=dataset)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Readers: each yields non-empty documents
# ---------------------------------------------------------------------------


def read_txt(path: Path) -> Iterator[str]:
    """Documents of a text file: runs of lines separated by blank (or whitespace-only) lines."""
    lines: list[str] = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                lines.append(line.rstrip("\n").rstrip("\r"))
            elif lines:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    """Documents of a JSON-lines file: the `text_field` of each object."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(
                    f"{path} line {number} is not valid JSON ({error.msg}); fix or remove that line"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise UsageError(
                    f"{path} line {number} has no field {text_field!r} (it has: {keys}); pass --text-field NAME"
                )
            text = record[text_field]
            if isinstance(text, str) and text.strip():
                yield text


def open_parquet(path: Path):
    """A pyarrow ParquetFile, or UsageError when pyarrow is missing or the file is not Parquet."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading .parquet files needs pyarrow: pip install pyarrow (or memfit[data])") from None
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own error types for corrupt files
        raise UsageError(f"{path} is not a readable Parquet file ({error}); check the file") from None


def load_hf_split(name: str, config: str | None, split: str, label: str):
    """A Hugging Face dataset split (downloaded once, then read from the HF cache), or UsageError saying what to fix."""
    try:
        import datasets
    except ImportError:
        raise UsageError("hf: datasets need the datasets package: pip install datasets (or memfit[data])") from None
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as error:  # network, unknown name, unknown split: all user-fixable
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"could not load {label} ({first_line}); check the name, config and split, and that the Hugging Face Hub"
            " is reachable (or already in your HF cache), or pass a local file to --dataset"
        ) from None


def read_parquet(path: Path, text_field: str) -> Iterator[str]:
    """Documents of a Parquet file: the `text_field` column, read one row group at a time."""
    parquet = open_parquet(path)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise UsageError(f"{path} has no column {text_field!r} (it has: {', '.join(columns)}); pass --text-field NAME")
    for group in range(parquet.num_row_groups):
        for text in parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def read_hf(name: str, config: str | None, split: str, text_field: str) -> Iterator[str]:
    """Documents of a Hugging Face dataset split (downloaded once, then read from the HF cache)."""
    label = f"hf:{name}" + (f":{config}" if config else "") + f"@{split}"
    data = load_hf_split(name, config, split, label)
    if text_field not in data.column_names:
        raise UsageError(
            f"{label} has no column {text_field!r} (it has: {', '.join(data.column_names)}); pass --text-field NAME"
        )
    for text in _iter_column(data, text_field):
        if isinstance(text, str) and text.strip():
            yield text


def _iter_column(data, text_field: str, batch: int = 1000) -> Iterator[str]:
    # Reading in slices keeps memory flat on large splits (data[field] would materialize all of it).
    for start in range(0, len(data), batch):
        yield from data[start : start + batch][text_field]

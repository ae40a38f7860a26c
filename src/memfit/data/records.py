"""Records (whole objects, not one text field) of JSONL, Parquet and Hugging Face sources.

Fine-tuning formats need every field of a record, where pretraining reads one text field
(`sources.py`). Records are yielded lazily in file order; `builtin:chat` names the small
conversation set shipped with memfit,
`builtin:preferences` its preference pairs (data/preferences.py), `builtin:prompts` its
arithmetic prompts with answers for --task grpo (data/prompts.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from memfit.data.sources import TextSource, load_hf_split, open_parquet, resolve_source
from memfit.errors import UsageError

BUILTIN_PREFIX = "builtin:"
BUILTIN_DATASETS = {"chat": ("chat", "chat.jsonl"), "preferences": ("chat", "preferences.jsonl"),
                    "prompts": ("chat", "prompts.jsonl")}


def builtin_path(name: str) -> Path:
    """The file of a dataset shipped with memfit (`builtin:chat`)."""
    if name not in BUILTIN_DATASETS:
        raise UsageError(f"unknown bundled dataset builtin:{name}; memfit ships: "
                         + ", ".join(f"builtin:{n}" for n in BUILTIN_DATASETS))
    path = Path(str(resources.files("memfit.data").joinpath(*BUILTIN_DATASETS[name])))
    if not path.is_file():
        raise UsageError(f"the bundled dataset builtin:{name} is missing at {path}; reinstall memfit")
    return path


def resolve(dataset: str | None, text_field: str = "text") -> TextSource:
    """`--dataset` -> a TextSource, `builtin:NAME` included (labelled by that name)."""
    if dataset is not None and dataset.strip().startswith(BUILTIN_PREFIX):
        name = dataset.strip()[len(BUILTIN_PREFIX):]
        return TextSource("jsonl", str(builtin_path(name)), text_field, label=f"builtin:{name}")
    return resolve_source(dataset, text_field)


def iter_records(source: TextSource) -> Iterator[Any]:
    """Every record of a JSONL, Parquet or Hugging Face source, in order (text files have none)."""
    if source.kind == "jsonl":
        yield from _jsonl(Path(source.location), source.label)
    elif source.kind == "parquet":
        yield from _parquet(Path(source.location))
    elif source.kind == "hf":
        yield from _hf(source)
    else:
        raise ValueError(f"{source.kind} sources hold text, not records")


def first_record(source: TextSource) -> Any | None:
    """The first record, or None for an empty source."""
    return next(iter_records(source), None)


def _jsonl(path: Path, label: str) -> Iterator[Any]:
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{label} line {number} is not valid JSON ({error.msg}); fix or remove that line") from None


def _parquet(path: Path) -> Iterator[Any]:
    parquet = open_parquet(path)
    for group in range(parquet.num_row_groups):
        yield from parquet.read_row_group(group).to_pylist()


def _hf(source: TextSource, batch: int = 1000) -> Iterator[Any]:
    data = load_hf_split(source.location, source.hf_config, source.hf_split, source.label)
    # Slices keep memory flat on large splits; a slice is columns, turned back into rows here.
    for start in range(0, len(data), batch):
        columns = data[start : start + batch]
        names = list(columns)
        for values in zip(*(columns[name] for name in names), strict=True):
            yield dict(zip(names, values, strict=True))

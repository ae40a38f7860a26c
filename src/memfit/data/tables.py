"""Sequence/label tables for tasks beyond causal LMs: CSV, TSV, JSONL, Parquet, hf: datasets and FASTA.

A table holds a sequence column (`--sequence-field`, default DNALLM's `sequence`) and one or
more label columns (`--label-fields`, default `label`). FASTA files carry the label at the end
of each header, `>id|label`. What a label means depends on the task (`LabelSpec.kind`):

- `class`: one class a row, a name or an integer id. Names are mapped to ids in sorted order
  (or the order of `--label-names`) and saved with the model as `id2label`; integer labels
  keep their value as the id.
- `multi-label`: several 0/1 columns (their names are the labels), or one column holding a
  list of label names (or a string of them separated by `,` or `;`).
- `number`: one float a label column (regression; several columns are several targets).
- `tokens`: one label a word of the sequence (words split on white space; a sequence
  without white space has one word a character, as DNA has one label a base). The first
  token of each word carries its label, the others and the special tokens none (-100).

Each sample is {"input_ids": LongTensor[n], "labels": ...}: a 0-d LongTensor (class), a
FloatTensor[num_labels] (multi-label, number) or a LongTensor[n] (tokens). A bad label (a
string in a number column, a class seen only in evaluation data, a missing label) raises one
UsageError naming the file and the row (1-based, header not counted). Tables are tokenized in
memory at start (no cache): they are short next to text corpora.
"""

from __future__ import annotations

import csv
import gzip
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.lengths import LengthPolicy, check_length_loss, say_length, start_policy
from memfit.data.windows import IGNORE_INDEX
from memfit.errors import UsageError

log = logging.getLogger("memfit")

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
FASTA_SUFFIXES = (".fa", ".fasta", ".fna", ".faa", ".ffn")
LABEL_KINDS = ("class", "multi-label", "number", "tokens", "none")


@dataclass
class LabelSpec:
    """What the label columns hold and how they map to ids (built from the training data)."""

    kind: str
    """One of LABEL_KINDS; `none` reads the sequences only (masked LM)."""
    fields: list[str]
    names: list[str] = field(default_factory=list)
    """Class or label names in id order (class, multi-label, tokens); target names (number)."""
    integer_ids: bool = False
    """class/tokens: the data holds integer ids, not names."""

    @property
    def num_labels(self) -> int:
        return max(1, len(self.names))

    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))


def is_table(dataset: str | None) -> bool:
    """Whether `--dataset` names a file this module reads as a table (by its suffix)."""
    if not dataset:
        return False
    name = dataset.lower().removesuffix(".gz")
    return name.endswith(TABLE_SUFFIXES + FASTA_SUFFIXES)


def iter_rows(dataset: str, sequence_field: str, label_table: str | None = None,
              id_field: str = "id") -> Iterator[dict[str, Any]]:
    """Every row of a table as a dict, in file order (FASTA: {sequence_field, "id", "label"}, or with `label_table`
    the label columns of each record's row there: memfit.data.fasta_labels)."""
    path = Path(dataset).expanduser()
    lower = dataset.lower().removesuffix(".gz")
    if not dataset.startswith("hf:") and not path.is_file():
        raise UsageError(f"dataset {dataset} does not exist; give a .csv, .tsv, .jsonl, .parquet or FASTA file, or hf:NAME")
    if label_table and not lower.endswith(FASTA_SUFFIXES):
        raise UsageError(f"--label-table labels FASTA records by id; {dataset} holds its own label columns: drop"
                         " --label-table (or name them with --label-fields)")
    if lower.endswith(FASTA_SUFFIXES) and label_table:
        from memfit.data.fasta_labels import with_side_labels

        yield from with_side_labels(_fasta(path, sequence_field), dataset, label_table, id_field, sequence_field)
    elif lower.endswith(FASTA_SUFFIXES):
        yield from _fasta(path, sequence_field)
    elif lower.endswith((".csv", ".tsv")):
        with _open_text(path) as handle:
            yield from csv.DictReader(handle, delimiter="\t" if lower.endswith(".tsv") else ",")
    else:
        from memfit.data.records import iter_records, resolve

        yield from iter_records(resolve(dataset, sequence_field))


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def _fasta(path: Path, sequence_field: str) -> Iterator[dict[str, Any]]:
    header, parts = None, []
    with _open_text(path) as handle:
        for line in handle:
            line = line.strip()
            if line.startswith(">"):
                if header is not None:
                    yield _fasta_record(header, parts, sequence_field)
                header, parts = line[1:], []
            elif line and header is not None:
                parts.append(line)
    if header is not None:
        yield _fasta_record(header, parts, sequence_field)


def _fasta_record(header: str, parts: list[str], sequence_field: str) -> dict[str, Any]:
    ident, _, label = header.partition("|")
    ident = (ident.split() or [""])[0]  # the id ends at the first space: a description may follow
    return {"id": ident, sequence_field: "".join(parts), "label": label.rsplit("|", 1)[-1].strip() or None}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, float) and math.isnan(value))


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _names_of(value: Any) -> list[str]:
    """Multi-label in one column: a list of names, or names separated by ',' or ';'."""
    if isinstance(value, list | tuple | np.ndarray):
        return [str(v).strip() for v in value if str(v).strip()]
    text = str(value)
    separator = ";" if ";" in text else ","
    return [part.strip() for part in text.split(separator) if part.strip()]


def _words(sequence: str) -> list[str]:
    return sequence.split() if any(ch.isspace() for ch in sequence.strip()) else list(sequence.strip())


def _token_labels(value: Any) -> list[Any]:
    if isinstance(value, list | tuple | np.ndarray):
        return list(value)
    return str(value).replace(",", " ").split()


def label_spec(dataset: str, kind: str, fields: list[str], sequence_field: str, label_names: list[str] | None,
               num_labels: int | None, label_table: str | None = None, id_field: str = "id") -> LabelSpec:
    """The label space of the training table: class names and ids, multi-label names, target names.

    Raises UsageError naming the row of a missing or unreadable label, or a label column the table lacks.
    """
    spec = LabelSpec(kind, fields)
    if kind == "none":
        return spec
    if kind == "number":
        spec.names = list(fields) if len(fields) > 1 else ["value"]
        return spec
    if kind == "multi-label" and len(fields) > 1:
        spec.names = list(fields)
        return spec
    found: set = set()
    column = fields[0]
    for number, row in enumerate(iter_rows(dataset, sequence_field, label_table, id_field), start=1):
        value = _cell(row, column, *_where(row, dataset, number))
        if kind == "multi-label":
            found.update(_names_of(value))
        elif kind == "tokens":
            found.update(str(v).strip() for v in _token_labels(value))
        else:
            found.add(str(value).strip() if _as_int(value) is None else _as_int(value))
    if label_names:
        spec.names = list(label_names)
        spec.integer_ids = all(isinstance(v, int) for v in found)
    elif found and all(isinstance(v, int) or _as_int(v) is not None for v in found):
        ids = sorted({v if isinstance(v, int) else _as_int(v) for v in found})
        if ids[0] < 0:
            raise UsageError(f"{dataset}: label {ids[0]} is negative; class ids start at 0 (or use class names)")
        spec.integer_ids = True
        spec.names = [str(i) for i in range(max(ids[-1] + 1, num_labels or 0))]
    else:
        spec.names = sorted(str(v) for v in found)
    if num_labels is not None and num_labels < len(spec.names):
        raise UsageError(f"--num-labels {num_labels} is fewer than the {len(spec.names)} classes of {dataset}"
                         f" ({', '.join(spec.names[:8])}); raise --num-labels or drop it")
    if num_labels is not None and not spec.integer_ids:
        spec.names += [f"LABEL_{i}" for i in range(len(spec.names), num_labels)]
    if kind == "class" and len(spec.names) < 2:
        raise UsageError(f"{dataset} has {len(spec.names)} class(es) in column {column!r}; classification needs two or more"
                         " (--task regression for numbers)")
    return spec


def _where(row: Any, dataset: str, number: int) -> tuple[str, int]:
    """(file, 1-based row) holding the labels of `row`: the label table's row for FASTA records labelled by
    --label-table, else the data's own."""
    from memfit.data.fasta_labels import TABLE_ROW

    return row[TABLE_ROW] if isinstance(row, dict) and TABLE_ROW in row else (dataset, number)


def _cell(row: Any, column: str, dataset: str, number: int) -> Any:
    if not isinstance(row, dict):
        raise UsageError(f"{dataset} row {number} is a {type(row).__name__}, not a record with fields")
    if column not in row:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise UsageError(f"{dataset} row {number} has no column {column!r} (it has: {keys}); name yours with --label-fields"
                         " or --sequence-field")
    value = row[column]
    if _missing(value):
        raise UsageError(f"{dataset} row {number}: the label in column {column!r} is missing; give every row a label")
    return value


class TableDataset(torch.utils.data.Dataset):
    """Tokenized table rows: `dataset[i]` is {"input_ids", "labels"} (see the module docstring)."""

    def __init__(self, input_ids: list[torch.Tensor], labels: list[torch.Tensor], spec: LabelSpec, source: str,
                 seq_len: int, rows: int, dropped_long: int, truncated: int, policy: LengthPolicy | None = None):
        self.policy = policy
        """What --seq-len (or the length from the data) and --truncate did (memfit.data.lengths)."""
        self.input_ids = input_ids
        self.labels = labels
        self.spec = spec
        self.source = source
        self.seq_len = seq_len
        self.stride = 0
        self.lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
        self.packing = "off"  # pooled heads read one sample a row: never packed
        self.supervised = True
        self.rows = rows
        self.dropped_long = dropped_long
        self.truncated = truncated

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_documents(self) -> int:
        return self.rows

    @property
    def num_target_tokens(self) -> int:
        if self.spec.kind == "tokens":
            return int(sum(int((labels != IGNORE_INDEX).sum()) for labels in self.labels))
        return len(self)

    @property
    def from_cache(self) -> bool:
        return False

    def data_facts(self) -> dict[str, Any]:
        policy = self.policy.facts() if self.policy is not None else {}
        return {**policy, "format": "table", "label_kind": self.spec.kind, "labels": self.spec.names[:64],
                "records": self.rows, "samples_kept": len(self), "tokens": self.num_tokens, "seq_len": self.seq_len,
                "samples_dropped_long": self.dropped_long, "samples_truncated": self.truncated}

    @property
    def description(self) -> str:
        kinds = {"class": f"{self.spec.num_labels} classes", "multi-label": f"{self.spec.num_labels} labels",
                 "number": f"{len(self.spec.fields)} target(s)", "tokens": f"{self.spec.num_labels} token labels",
                 "none": "sequences only"}
        # What the length dropped or cut has lines of its own (memfit.data.lengths.length_lines).
        return (f"{self.source}: {self.rows:,} rows ({kinds[self.spec.kind]}), {len(self):,} samples of <= {self.seq_len}"
                f" tokens, {self.num_tokens:,} tokens")


def load_table(dataset: str, spec: LabelSpec, tokenizer: Any, *, sequence_field: str, seq_len: int | None,
               truncate: bool, min_samples: int = 1, role: str = "training", label_table: str | None = None,
               id_field: str = "id", allow_drop: bool = False, max_positions: int | None = None,
               say: bool = True) -> TableDataset:
    """Read and tokenize a table against the label space `spec` (built from the training table).

    `seq_len` None: the length comes from the rows (memfit.data.lengths.seq_len_from_data), within `max_positions`.
    A row longer than the length is dropped, or cut to its start with `truncate`.

    Raises UsageError naming the row of a bad label, when the length would drop more than 1% of the rows or
    target tokens (unless `allow_drop`), or when fewer than `min_samples` samples remain.
    """
    index = {name: i for i, name in enumerate(spec.names)}
    read: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = 0
    for number, row in enumerate(iter_rows(dataset, sequence_field, label_table, id_field), start=1):
        rows += 1
        if not isinstance(row, dict) or _missing(row.get(sequence_field)):
            raise UsageError(f"{dataset} row {number} has no sequence in column {sequence_field!r}; name the column with"
                             " --sequence-field")
        sequence = str(row[sequence_field])
        where = _where(row, dataset, number)  # a side table's row names a bad label
        if spec.kind == "tokens":
            ids, label = _tokens_with_labels(tokenizer, sequence, _cell(row, spec.fields[0], *where), index, spec, *where)
        else:
            ids = torch.tensor(tokenizer(sequence, add_special_tokens=True)["input_ids"], dtype=torch.long)
            label = _row_label(row, spec, index, *where)
        read.append((ids, label))
    lengths = np.array([len(ids) for ids, _ in read], dtype=np.int64)
    targets = np.array([_target_count(label, spec) for _, label in read], dtype=np.int64)
    policy = start_policy(lengths, targets, seq_len, truncate, max_positions)
    seq_len = policy.seq_len
    input_ids: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    kept: list[int] = []
    for sample, ((ids, label), count) in enumerate(zip(read, targets.tolist(), strict=True)):
        if len(ids) > seq_len:
            if not truncate:
                policy.dropped_long += 1
                policy.target_tokens_lost += count
                continue
            ids, label = _truncate(ids, seq_len, tokenizer, label)
            policy.truncated += 1
            policy.target_tokens_lost += count - _target_count(label, spec)
        input_ids.append(ids)
        labels.append(label)
        kept.append(sample)
    policy.kept = np.asarray(kept, dtype=np.int64)
    policy.lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
    policy.targets = np.array([_target_count(label, spec) for label in labels], dtype=np.int64)
    if input_ids:  # none left: the message below says so, with what was dropped
        check_length_loss(policy, dataset, allow_drop)
    if len(input_ids) < min_samples:
        keep = policy.seq_len_keeping_all
        raise UsageError(f"{dataset} has {len(input_ids)} samples of <= {seq_len} tokens ({policy.dropped_long} longer"
                         f" dropped), fewer than {'one effective batch' if role == 'training' else 'one'} ({min_samples});"
                         f" {f'pass --seq-len {keep}' if keep and policy.dropped_long else 'raise --seq-len'},"
                         " add --truncate, or lower the batch")
    if say:
        say_length(policy, dataset, allow_drop, log)
    return TableDataset(input_ids, labels, spec, dataset, seq_len, rows, policy.dropped_long, policy.truncated, policy)


def _target_count(label: torch.Tensor, spec: LabelSpec) -> int:
    """What a sample adds to the loss's count: its labelled tokens (token classification), else the sample itself."""
    return int((label != IGNORE_INDEX).sum()) if spec.kind == "tokens" else 1


def _truncate(ids: torch.Tensor, seq_len: int, tokenizer: Any,
              label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len tokens, keeping the closing special token (SEP / EOS) where the tokenizer adds one; a label
    a token (token classification) is cut alike, a label a sample stays."""
    per_token = label.dim() == 1 and label.dtype == torch.long
    closing = getattr(tokenizer, "sep_token_id", None)
    if closing is not None and int(ids[-1]) == closing:
        cut = torch.cat([ids[: seq_len - 1], ids[-1:]])
        return cut, torch.cat([label[: seq_len - 1], label[-1:]]) if per_token else label
    return ids[:seq_len], label[:seq_len] if per_token else label


def _row_label(row: dict, spec: LabelSpec, index: dict[str, int], dataset: str, number: int) -> torch.Tensor:
    if spec.kind == "none":
        return torch.zeros((), dtype=torch.long)
    if spec.kind == "number":
        values = []
        for column in spec.fields:
            value = _cell(row, column, dataset, number)
            try:
                values.append(float(value))
            except (TypeError, ValueError):
                raise UsageError(f"{dataset} row {number}: column {column!r} holds {value!r}, not a number; regression"
                                 " labels are numbers") from None
            if not math.isfinite(values[-1]):
                raise UsageError(f"{dataset} row {number}: column {column!r} holds {value!r}; labels must be finite")
        return torch.tensor(values, dtype=torch.float32)
    if spec.kind == "multi-label":
        target = torch.zeros(spec.num_labels, dtype=torch.float32)
        if len(spec.fields) > 1:
            for i, column in enumerate(spec.fields):
                value = _as_int(_cell(row, column, dataset, number))
                if value not in (0, 1):
                    raise UsageError(f"{dataset} row {number}: column {column!r} holds {row[column]!r}; multi-label columns"
                                     " hold 0 or 1")
                target[i] = value
            return target
        for name in _names_of(_cell(row, spec.fields[0], dataset, number)):
            target[_class_id(name, index, spec, dataset, number)] = 1.0
        return target
    return torch.tensor(_class_id(_cell(row, spec.fields[0], dataset, number), index, spec, dataset, number),
                        dtype=torch.long)


def _class_id(value: Any, index: dict[str, int], spec: LabelSpec, dataset: str, number: int) -> int:
    as_int = _as_int(value)
    if spec.integer_ids and as_int is not None:
        if 0 <= as_int < spec.num_labels:
            return as_int
    elif str(value).strip() in index:
        return index[str(value).strip()]
    known = ", ".join(spec.names[:10]) + (", ..." if len(spec.names) > 10 else "")
    raise UsageError(f"{dataset} row {number}: class {value!r} is not one of the training data's classes ({known});"
                     " fix the row or pass --label-names with every class")


def _tokens_with_labels(tokenizer: Any, sequence: str, value: Any, index: dict[str, int], spec: LabelSpec,
                        dataset: str, number: int) -> tuple[torch.Tensor, torch.Tensor]:
    words = _words(sequence)
    word_labels = _token_labels(value)
    if len(word_labels) != len(words):
        raise UsageError(f"{dataset} row {number}: {len(word_labels)} token labels for {len(words)} words of the sequence;"
                         " give one label a word (a character when the sequence has no spaces)")
    word_ids = [_class_id(label, index, spec, dataset, number) for label in word_labels]
    if getattr(tokenizer, "is_fast", False):
        # The tokenizer's own word alignment, special tokens (its post-processor) included.
        encoding = tokenizer(words, is_split_into_words=True, add_special_tokens=True)
        full, previous = [], None
        for word in encoding.word_ids():
            full.append(IGNORE_INDEX if word is None or word == previous else word_ids[word])
            previous = word
        return torch.tensor(encoding["input_ids"], dtype=torch.long), torch.tensor(full, dtype=torch.long)
    ids: list[int] = []
    labels: list[int] = []
    for word, label in zip(words, word_ids, strict=True):
        pieces = tokenizer(word, add_special_tokens=False)["input_ids"]
        ids += pieces
        labels += [label] + [IGNORE_INDEX] * (len(pieces) - 1) if pieces else []
    with_special = tokenizer.build_inputs_with_special_tokens(ids) if hasattr(tokenizer, "build_inputs_with_special_tokens") else ids
    # Special tokens wrap the words (CLS before, SEP after): find where the words start and pad the labels around them.
    start = _find(with_special, ids)
    full = [IGNORE_INDEX] * start + labels + [IGNORE_INDEX] * (len(with_special) - start - len(ids))
    return torch.tensor(with_special, dtype=torch.long), torch.tensor(full, dtype=torch.long)


def _find(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return 0

"""FASTA labels from a side table (--label-table): a CSV/TSV/JSONL mapping each record id to its label(s).

Sequence collections often keep their labels apart from the sequences: `regions.fa` holds
`>chr1:100-600` records and `labels.csv` holds `id,label` rows. With `--label-table labels.csv`
each FASTA record takes the label columns of the table row whose `--id-field` (default `id`)
equals the record id (the header up to the first `|` or white space, as tables.iter_rows reads
it). The table may hold rows for records that are not in the FASTA file (one table can label a
training and an evaluation file); a record without a row, an id given twice or a table without
the id column is refused in one line naming the row. A label that does not fit the task is
named by its row in the label table, not in the FASTA file.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

TABLE_ROW = "_label_table_row"
"""Key of a merged record: (label table path, 1-based row) of its labels, for error messages."""


def read_label_table(path: str, id_field: str) -> dict[str, tuple[int, dict[str, Any]]]:
    """id -> (row number, row) of a label table (.csv, .tsv, .jsonl/.json).

    Raises UsageError for a missing file, a missing id column, an empty or repeated id.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"--label-table {path} does not exist; give a .csv, .tsv or .jsonl file mapping record ids to labels")
    lower = path.lower()
    if lower.endswith((".csv", ".tsv")):
        with file.open(encoding="utf-8", newline="") as handle:
            rows: list[Any] = list(csv.DictReader(handle, delimiter="\t" if lower.endswith(".tsv") else ","))
    elif lower.endswith((".jsonl", ".json")):
        from memfit.data.records import iter_records, resolve

        rows = list(iter_records(resolve(path, id_field)))
    else:
        raise UsageError(f"--label-table {path}: give a .csv, .tsv or .jsonl file (id column and label columns)")
    table: dict[str, tuple[int, dict[str, Any]]] = {}
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or id_field not in row:
            keys = ", ".join(sorted(map(str, row))) if isinstance(row, dict) else type(row).__name__
            raise UsageError(f"{path} row {number} has no column {id_field!r} (it has: {keys}); name the id column with"
                             " --id-field")
        ident = str(row[id_field] or "").strip()
        if not ident:
            raise UsageError(f"{path} row {number}: the id in column {id_field!r} is empty; give every row a record id")
        if ident in table:
            raise UsageError(f"{path} row {number}: id {ident!r} appears again (first at row {table[ident][0]}); give each"
                             " record one row")
        table[ident] = (number, row)
    return table


def with_side_labels(records: Iterator[dict[str, Any]], fasta: str, label_table: str, id_field: str,
                     sequence_field: str) -> Iterator[dict[str, Any]]:
    """The FASTA `records` with the label columns of their rows in `label_table` (see the module docstring)."""
    table = read_label_table(label_table, id_field)
    for number, record in enumerate(records, start=1):
        ident = record["id"]
        if ident not in table:
            raise UsageError(f"{fasta} record {number} (id {ident!r}) has no row in {label_table}; add one or drop the"
                             " record")
        row_number, row = table[ident]
        merged = {name: value for name, value in row.items() if name not in (id_field, sequence_field)}
        merged.update({"id": ident, sequence_field: record[sequence_field], TABLE_ROW: (label_table, row_number)})
        yield merged

"""FASTA labels from a side table (--label-table): the same samples as a CSV holding sequences and labels together,
and every bad table refused in one line naming its row."""

from __future__ import annotations

import pytest
import torch

from memfit.data.tables import label_spec, load_table
from memfit.errors import UsageError
from tiny_encoders import dna_rows, dna_tokenizer, write_csv


def _fasta(path, rows, describe=True):
    path.write_text("".join(f">rec{i}{' sample ' + str(i) if describe else ''}\n{r['sequence'][:15]}\n{r['sequence'][15:]}\n"
                            for i, r in enumerate(rows)))
    return path


def _side_table(path, rows, extra=True, delimiter=","):
    table = [{"id": f"rec{i}", "label": r["label"], "value": r["value"]} for i, r in enumerate(rows)]
    table.reverse()  # another order than the FASTA's
    if extra:
        table.append({"id": "elsewhere", "label": "low", "value": 0.1})  # a record of another file
    return write_csv(path, table, delimiter=delimiter)


def _load(dataset, kind="class", fields=("label",), label_table=None):
    spec = label_spec(str(dataset), kind, list(fields), "sequence", None, None, label_table)
    return load_table(str(dataset), spec, dna_tokenizer(), sequence_field="sequence", seq_len=64, truncate=False,
                      label_table=label_table)


@pytest.mark.parametrize(("kind", "field"), [("class", "label"), ("number", "value")])
def test_side_table_labels_equal_a_table_holding_them(tmp_path, kind, field):
    rows = dna_rows(9, min_length=20, max_length=40)
    together = _load(write_csv(tmp_path / "t.csv", rows), kind, (field,))
    side = _load(_fasta(tmp_path / "t.fa", rows), kind, (field,), str(_side_table(tmp_path / "labels.tsv", rows,
                                                                                      delimiter="\t")))
    assert len(side) == len(together) == 9
    assert side.spec.names == together.spec.names
    for i in range(9):
        assert torch.equal(side[i]["input_ids"], together[i]["input_ids"])
        assert torch.equal(side[i]["labels"], together[i]["labels"])


def _bad(tmp_path, case):
    rows = dna_rows(4)
    fasta = _fasta(tmp_path / "t.fa", rows, describe=False)
    labels = [{"id": f"rec{i}", "label": r["label"]} for i, r in enumerate(rows)]
    if case == "record without a row":
        labels.pop(2)
        expected = "t.fa record 3 (id 'rec2') has no row in"
    elif case == "id given twice":
        labels.append({"id": "rec1", "label": "low"})
        expected = "labels.csv row 5: id 'rec1' appears again (first at row 2)"
    elif case == "missing label":
        labels[1]["label"] = ""
        expected = "labels.csv row 2: the label in column 'label' is missing"
    else:
        labels = [{"name": entry["id"], "label": entry["label"]} for entry in labels]
        expected = "labels.csv row 1 has no column 'id' (it has: label, name); name the id column with --id-field"
    return fasta, write_csv(tmp_path / "labels.csv", labels), expected


@pytest.mark.parametrize("case", ["record without a row", "id given twice", "missing label", "no id column"])
def test_bad_side_tables_name_the_row(tmp_path, case):
    fasta, labels, expected = _bad(tmp_path, case)
    with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _load(fasta, label_table=str(labels))


def test_a_label_that_does_not_fit_is_named_by_its_row_in_the_side_table(tmp_path):
    rows = dna_rows(4)
    fasta = _fasta(tmp_path / "t.fa", rows)
    labels = write_csv(tmp_path / "labels.csv", [{"id": f"rec{i}", "value": "n/a" if i == 2 else 0.5} for i in range(4)])
    with pytest.raises(UsageError, match="labels.csv row 3: column 'value' holds 'n/a', not a number"):
        _load(fasta, "number", ("value",), str(labels))


def _train(warm_memfit, tmp_path, *args):
    # `memfit train` forked from the session's warm server (tests/memfit_cli.py): a fresh interpreter would import
    # torch and transformers again for each of these short runs
    return warm_memfit.run("train", "--batch-size", "4", "--max-steps", "1", "--seq-len", "64", "--no-report",
                           "--output-dir", str(tmp_path / "out"), *args)


def test_cli_trains_from_fasta_and_side_table(encoder_dirs, tmp_path, warm_memfit):
    rows = dna_rows(8)
    fasta = _fasta(tmp_path / "t.fa", rows)
    run = _train(warm_memfit, tmp_path, "--model", str(encoder_dirs["bert"]), "--task", "sequence-classification", "--dataset",
                 str(fasta), "--label-table", str(_side_table(tmp_path / "labels.csv", rows)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out" / "final" / "config.json").exists()


@pytest.mark.parametrize("case", ["bad side table", "side table for a csv", "side table for masked-lm"])
def test_cli_refuses_in_one_line_and_writes_nothing(encoder_dirs, dna_csv, tmp_path, case, warm_memfit):
    task = "sequence-classification"
    if case == "bad side table":
        dataset, labels, expected = _bad(tmp_path, "id given twice")
    elif case == "side table for a csv":
        dataset, labels = dna_csv, _side_table(tmp_path / "labels.csv", dna_rows(4))
        expected = "--label-table labels FASTA records by id;"
    else:
        dataset, labels = _fasta(tmp_path / "t.fa", dna_rows(8)), _side_table(tmp_path / "labels.csv", dna_rows(8))
        task, expected = "masked-lm", "--label-table labels FASTA records for a task with labels; --task masked-lm"
    run = _train(warm_memfit, tmp_path, "--model", str(encoder_dirs["esm"]), "--task", task, "--dataset", str(dataset),
                 "--label-table", str(labels))
    assert run.returncode == 2, run.stderr[-2000:]
    assert expected in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2, run.stderr
    assert not (tmp_path / "out").exists()

"""Sequence/label tables: formats, label spaces saved with the model, and bad labels refused in one line."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from memfit.data.tables import label_spec, load_table
from memfit.errors import UsageError
from tiny_encoders import dna_rows, dna_tokenizer, write_csv

MEMFIT = [sys.executable, "-m", "memfit"]


def _spec(path, kind="class", fields=("label",), names=None, num_labels=None):
    return label_spec(str(path), kind, list(fields), "sequence", names, num_labels)


def test_class_names_map_to_sorted_ids(tmp_path):
    path = write_csv(tmp_path / "t.csv", dna_rows(9))
    spec = _spec(path)
    assert spec.names == ["high", "low", "mid"]
    table = load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=64, truncate=False)
    assert [int(table[i]["labels"]) for i in range(3)] == [1, 2, 0]  # low, mid, high
    first = table[0]["input_ids"]
    assert int(first[0]) == dna_tokenizer().cls_token_id and int(first[-1]) == dna_tokenizer().sep_token_id


def test_tsv_jsonl_and_fasta_read_the_same_rows(tmp_path):
    rows = dna_rows(6)
    csv_path = write_csv(tmp_path / "t.csv", rows)
    tsv_path = write_csv(tmp_path / "t.tsv", rows, delimiter="\t")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fasta = tmp_path / "t.fa"
    fasta.write_text("".join(f">seq{i}|{r['label']}\n{r['sequence'][:20]}\n{r['sequence'][20:]}\n" for i, r in enumerate(rows)))
    tables = []
    for path in (csv_path, tsv_path, jsonl, fasta):
        tables.append(load_table(str(path), _spec(path), dna_tokenizer(), sequence_field="sequence", seq_len=64,
                                 truncate=False))
    for table in tables[1:]:
        for i in range(len(rows)):
            assert torch.equal(table[i]["input_ids"], tables[0][i]["input_ids"])
            assert torch.equal(table[i]["labels"], tables[0][i]["labels"])


def test_integer_labels_keep_their_ids_and_multi_label_columns(tmp_path):
    rows = [{"sequence": "ACGT", "label": i % 2, "a": i % 2, "b": 1} for i in range(4)]
    path = write_csv(tmp_path / "t.csv", rows)
    assert _spec(path).names == ["0", "1"] and _spec(path).integer_ids
    multi = _spec(path, "multi-label", ("a", "b"))
    table = load_table(str(path), multi, dna_tokenizer(), sequence_field="sequence", seq_len=16, truncate=False)
    assert table[1]["labels"].tolist() == [1.0, 1.0] and table[0]["labels"].tolist() == [0.0, 1.0]


def test_token_labels_sit_on_the_bases_not_the_special_tokens(tmp_path):
    path = write_csv(tmp_path / "t.csv", [{"sequence": "ACGT", "tags": "0 1 1 0"}, {"sequence": "GG", "tags": "1 1"}])
    spec = _spec(path, "tokens", ("tags",))
    table = load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=16, truncate=False)
    assert table[0]["labels"].tolist() == [-100, 0, 1, 1, 0, -100]


@pytest.mark.parametrize(("rows", "kind", "message"), [
    ([{"sequence": "ACGT", "label": "1.5"}, {"sequence": "ACG", "label": "high"}], "number", "row 2: column 'label' holds 'high', not a number"),
    ([{"sequence": "ACGT", "label": "a"}, {"sequence": "ACG", "label": ""}, {"sequence": "A", "label": "b"}], "class", "row 2: the label in column 'label' is missing"),
    ([{"sequence": "ACGT", "tags": "0 1"}], "tokens", "row 1: 2 token labels for 4 words"),
])
def test_bad_labels_name_the_row(tmp_path, rows, kind, message):
    path = write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(UsageError, match=message):
        fields = ("tags",) if kind == "tokens" else ("label",)
        spec = _spec(path, kind, fields)
        load_table(str(path), spec, dna_tokenizer(), sequence_field="sequence", seq_len=16, truncate=False)


def _train(warm_memfit, args, tmp_path):
    # `memfit train` forked from the session's warm server (tests/memfit_cli.py): a fresh interpreter would import
    # torch and transformers again for each of these short runs
    return warm_memfit.run("train", "--batch-size", "4", "--max-steps", "2", "--seq-len", "64", "--no-report",
                           "--output-dir", str(tmp_path / "out"), *args)


def test_class_names_are_saved_with_the_model(encoder_dirs, dna_csv, tmp_path, warm_memfit):
    run = _train(warm_memfit, ["--model", str(encoder_dirs["bert"]), "--task", "sequence-classification", "--dataset", str(dna_csv)],
                 tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "high", "1": "low", "2": "mid"}
    assert config["architectures"] == ["BertForSequenceClassification"]


@pytest.mark.parametrize("case", ["eval-only class", "string in regression", "missing label"])
def test_bad_labels_exit_2_and_write_nothing(encoder_dirs, dna_csv, tmp_path, case, warm_memfit):
    rows = dna_rows(8)
    args = ["--model", str(encoder_dirs["esm"]), "--task", "sequence-classification", "--dataset", str(dna_csv)]
    if case == "eval-only class":
        rows[5]["label"] = "extreme"
        args += ["--eval-dataset", str(write_csv(tmp_path / "eval.csv", rows))]
        expected = "row 6: class 'extreme' is not one of the training data's classes"
    elif case == "string in regression":
        rows[3]["value"] = "n/a"
        args = ["--model", str(encoder_dirs["esm"]), "--task", "regression", "--label-fields", "value",
                "--dataset", str(write_csv(tmp_path / "bad.csv", rows))]
        expected = "row 4: column 'value' holds 'n/a', not a number"
    else:
        rows[2]["label"] = ""
        args[-1] = str(write_csv(tmp_path / "bad.csv", rows))
        expected = "row 3: the label in column 'label' is missing"
    run = _train(warm_memfit, args, tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert expected in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()

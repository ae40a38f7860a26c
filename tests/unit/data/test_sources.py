"""Readers: every format yields the documents, and bad input says what to do."""

from __future__ import annotations

import builtins
import json

import pytest

from memfit.data.sources import bundled_corpus_path, resolve_source
from memfit.errors import UsageError


def documents(dataset, text_field="text"):
    return list(resolve_source(str(dataset), text_field).documents())


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\nstill first\n\n\n  \nsecond\n\nthird\n")
    assert documents(path) == ["first line\nstill first", "second", "third"]


def test_jsonl_reads_the_text_field_and_skips_empty_texts(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"body": "one", "id": 1}, {"body": "  "}, {"body": "two"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert documents(path, "body") == ["one", "two"]


def test_jsonl_missing_field_names_the_flag(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(UsageError, match="no field 'text'.*--text-field"):
        documents(path)


def test_jsonl_bad_line_names_the_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(UsageError, match="line 2 is not valid JSON"):
        documents(path)


def test_parquet_reads_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    table = pa.table({"text": ["alpha", "", None, "beta gamma"], "n": [1, 2, 3, 4]})
    pq.write_table(table, path, row_group_size=2)
    assert documents(path) == ["alpha", "beta gamma"]
    with pytest.raises(UsageError, match="no column 'body'.*--text-field"):
        documents(path, "body")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1")
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(UsageError, match="pip install pyarrow"):
        documents(path)


@pytest.mark.parametrize(
    "spec, name, config, split",
    [
        ("hf:wikitext", "wikitext", None, "train"),
        ("hf:wikitext:wikitext-2-raw-v1", "wikitext", "wikitext-2-raw-v1", "train"),
        ("hf:user/data:cfg@validation", "user/data", "cfg", "validation"),
        ("hf:user/data@test", "user/data", None, "test"),
    ],
)
def test_hf_names_are_parsed(spec, name, config, split):
    source = resolve_source(spec)
    assert (source.kind, source.location, source.hf_config, source.hf_split) == ("hf", name, config, split)
    assert source.identity() == {"kind": "hf", "name": name, "config": config, "split": split}


def test_hf_without_datasets_or_network_is_one_clear_line(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(UsageError, match="pip install datasets"):
        documents("hf:some/dataset")


def test_hf_load_failure_is_a_usage_error(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub\nmore detail")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(UsageError, match=r"could not load hf:x/y@train \(Couldn't reach the Hub\).*local file") as info:
        documents("hf:x/y")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", "does not exist"),
        (lambda d: d, "is a directory"),
        (lambda d: (d / "data.csv").write_text("a,b") and d / "data.csv", "unsupported file type '.csv'"),
        (lambda d: "hf:", "name the dataset"),
    ],
)
def test_bad_sources_raise_one_line(tmp_path, make, message):
    with pytest.raises(UsageError, match=message) as info:
        resolve_source(str(make(tmp_path)))
    assert "\n" not in str(info.value)


def test_bundled_corpus_is_the_default_and_is_real_text():
    source = resolve_source(None)
    assert source.label == "bundled corpus"
    assert bundled_corpus_path().stat().st_size > 60_000
    docs = list(source.documents())
    assert len(docs) > 100
    assert sum(len(doc.split()) for doc in docs) > 12_000
    assert (bundled_corpus_path().parent / "README.md").is_file()

"""Record formats: recognised from the first record's fields, converted to messages, bad records named."""

from __future__ import annotations

import json

import pytest

from memfit.data.formats import FieldNames, detect_format, to_example
from memfit.data.records import builtin_path, iter_records, resolve
from memfit.data.samples import resolve_format
from memfit.data.sources import TextSource
from memfit.errors import UsageError

FIELDS = FieldNames()
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."}]


@pytest.mark.parametrize(("record", "expected"), [
    ({"text": "plain"}, "text"),
    ({"messages": CHAT}, "messages"),
    ({"prompt": "2+2=", "completion": "4"}, "prompt-completion"),
    ({"prompt": CHAT[:2], "completion": CHAT[2:3]}, "prompt-completion"),
    ({"instruction": "Add", "input": "2 and 2", "output": "4"}, "alpaca"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}, "sharegpt"),
])
def test_every_format_is_recognised_from_its_fields(record, expected):
    assert detect_format(record, FIELDS, "data.jsonl") == expected


def test_field_names_can_be_mapped():
    fields = FieldNames(messages="dialog", prompt="question", completion="answer", text="body")
    assert detect_format({"dialog": CHAT}, fields, "d") == "messages"
    assert detect_format({"question": "q", "answer": "a"}, fields, "d") == "prompt-completion"
    assert detect_format({"body": "t"}, fields, "d") == "text"
    example = to_example({"dialog": CHAT}, "messages", 1, fields, "d")
    assert [m["role"] for m in example.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_unknown_fields_are_refused_with_what_the_record_has():
    with pytest.raises(UsageError, match=r"record 1 has none of the fields.*it has: id, question"):
        detect_format({"question": "q", "id": 1}, FIELDS, "data.jsonl")


def test_messages_trainable_turns_are_the_assistant_turns():
    example = to_example({"messages": CHAT}, "messages", 1, FIELDS, "d")
    assert example.trainable == [2, 4]


def test_alpaca_becomes_a_user_and_an_assistant_turn():
    example = to_example({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}, "alpaca", 1, FIELDS, "d")
    assert example.messages == [{"role": "user", "content": "Add the numbers.\n\n2 and 3"},
                                {"role": "assistant", "content": "5"}]
    without_input = to_example({"instruction": "Say hi.", "input": "", "output": "hi"}, "alpaca", 1, FIELDS, "d")
    assert without_input.messages[0] == {"role": "user", "content": "Say hi."}


def test_sharegpt_speakers_become_roles():
    record = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                {"from": "gpt", "value": "A"}]}
    example = to_example(record, "sharegpt", 1, FIELDS, "d")
    assert [m["role"] for m in example.messages] == ["system", "user", "assistant"]
    assert example.trainable == [2]


def test_prompt_completion_strings_and_messages():
    plain = to_example({"prompt": "2+2=", "completion": "4"}, "prompt-completion", 1, FIELDS, "d")
    assert not plain.conversational and (plain.prompt, plain.completion) == ("2+2=", "4")
    chat = to_example({"prompt": CHAT[:4], "completion": CHAT[4:]}, "prompt-completion", 1, FIELDS, "d")
    # Only the completion trains: the assistant turn inside the prompt is context.
    assert chat.conversational and chat.trainable == [4]


@pytest.mark.parametrize(("record", "fmt", "expected"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", r"record 7: field 'messages' has no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "Hi"}, {"role": "assistant", "content": "x"}]}, "messages",
     r"record 7: field 'messages' turn 1 has unknown role 'wizard'"),
    ({"msgs": CHAT}, "messages", r"record 7 has no field 'messages' \(it has: msgs\); .*--messages-field"),
    ({"messages": [{"content": "Hi"}]}, "messages", r"record 7: field 'messages' turn 1 has no 'role'"),
    ({"prompt": "q"}, "prompt-completion", r"record 7 has no field 'completion'"),
    ({"prompt": "q", "completion": ["a"]}, "prompt-completion", r"record 7: fields 'prompt' and 'completion' must both"),
    ({"instruction": "q"}, "alpaca", r"record 7 has no field 'output'"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", r"record 7: field 'conversations' turn 1 has unknown speaker"),
])
def test_a_bad_record_is_one_line_naming_record_and_field(record, fmt, expected):
    with pytest.raises(UsageError, match=expected) as caught:
        to_example(record, fmt, 7, FIELDS, "data.jsonl")
    assert "\n" not in str(caught.value)


def test_jsonl_and_hf_like_parquet_records_are_read_and_detected(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": CHAT}, {"messages": CHAT[:3]}]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    # A Hugging Face dataset exported to Parquet: a list-of-struct column, as `datasets` writes messages.
    parquet = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pyarrow.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        source = resolve(str(path))
        assert resolve_format(source, "auto", FIELDS) == "messages"
        records = list(iter_records(source))
        assert [to_example(r, "messages", i, FIELDS, "d").messages for i, r in enumerate(records, 1)] == [CHAT, CHAT[:3]]


def test_text_files_are_text_and_refuse_a_record_format(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some text")
    source = TextSource("txt", str(path), label=str(path))
    assert resolve_format(source, "auto", FIELDS) == "text"
    with pytest.raises(UsageError, match="--dataset-format messages needs records"):
        resolve_format(source, "messages", FIELDS)


def test_forced_format_wins_over_detection(tmp_path):
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"text": "t", "messages": CHAT}) + "\n")
    source = resolve(str(path))
    assert resolve_format(source, "auto", FIELDS) == "messages"
    assert resolve_format(source, "text", FIELDS) == "text"


def test_builtin_chat_is_shipped_and_every_record_is_valid():
    source = resolve("builtin:chat")
    assert source.label == "builtin:chat" and builtin_path("chat").is_file()
    records = list(iter_records(source))
    assert len(records) >= 300
    examples = [to_example(r, "messages", i, FIELDS, "builtin:chat") for i, r in enumerate(records, 1)]
    assert any(len(e.trainable) >= 3 for e in examples)  # multi-turn
    assert any(e.messages[0]["role"] == "system" for e in examples)
    with pytest.raises(UsageError, match="unknown bundled dataset builtin:nope"):
        resolve("builtin:nope")


def test_hf_dataset_records_are_read_as_rows(monkeypatch):
    """`hf:` sources go through `datasets.load_dataset` (faked here: nothing is downloaded) and come back as rows."""
    import sys
    import types

    rows = [{"messages": CHAT, "id": i} for i in range(2500)]  # more than one slice of 1,000

    class FakeSplit:
        column_names = ["messages", "id"]

        def __len__(self):
            return len(rows)

        def __getitem__(self, window):  # a slice of a Dataset is a dict of columns
            return {name: [row[name] for row in rows[window]] for name in self.column_names}

    calls = []
    fake = types.SimpleNamespace(load_dataset=lambda name, config, split: calls.append((name, config, split)) or FakeSplit())
    monkeypatch.setitem(sys.modules, "datasets", fake)
    source = resolve("hf:someone/chats:default@train")
    assert resolve_format(source, "auto", FIELDS) == "messages"
    records = list(iter_records(source))
    assert [r["id"] for r in records] == list(range(2500)) and records[7]["messages"] == CHAT
    assert calls[-1] == ("someone/chats", "default", "train")

"""The real CLI on a chat set most of whose conversations are longer than 256 tokens (the old default --seq-len).

`memfit train --seq-len 256` refuses to drop them (exit 2, one line, nothing written); without --seq-len the length
comes from the data and nothing is dropped; --allow-drop and --truncate run; plain text keeps 256; `memfit data` says
the drop on a line of its own with the --seq-len that keeps every sample.
"""

from __future__ import annotations

import json
import random

import pytest

WORDS = "the of a memory model train token sample answer question long short GPU batch data loss".split()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """50 multi-turn conversations of varied length (about 100 to 700 byte tokens)."""
    rng = random.Random(3)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."

    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    with path.open("w") as handle:
        for _ in range(50):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "user", "content": sentence(2, 10)}, {"role": "assistant", "content": sentence(3, 30)}]
            handle.write(json.dumps({"messages": turns}) + "\n")
    return path


def start_record(out) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("event") == "start")


RUN = ("--batch-size", "2", "--max-steps", "1", "--no-report")


def test_a_drop_over_one_percent_is_refused_in_one_line_and_nothing_is_written(chats, tmp_path, warm_memfit):
    out = tmp_path / "run"
    result = warm_memfit.run("train", "--dataset", chats, "--seq-len", "256", "--output-dir", out, *RUN)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memfit train: error: --seq-len 256 would drop ")
    assert "of 50 samples" in lines[0] and "target tokens" in lines[0]
    assert "--seq-len 704 to keep them" in lines[0] and "--truncate" in lines[0] and "--allow-drop" in lines[0]
    assert not out.exists()


def test_without_seq_len_the_length_comes_from_the_data_and_no_sample_is_dropped(chats, tmp_path, warm_memfit):
    out = tmp_path / "run"
    result = warm_memfit.run("train", "--dataset", chats, "--output-dir", out, *RUN)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "from the data" in line]
    assert said == ["memfit: seq-len 704 from the data (longest sample 681 tokens; keeps 50 of 50 samples)"], result.stderr
    start = start_record(out)
    assert start["seq_len"] == 704
    assert start["data"]["samples_kept"] == 50 and start["data"]["samples_dropped_long"] == 0
    assert start["data"]["target_tokens_lost"] == 0


@pytest.mark.parametrize(("flag", "kept", "said"), [
    ("--allow-drop", 16, "memfit: --allow-drop: --seq-len 256 drops 34 of 50 samples"),
    ("--truncate", 50, "memfit: --truncate: 34 of 50 samples"),
])
def test_allow_drop_and_truncate_run_and_say_what_it_cost(flag, kept, said, chats, tmp_path, warm_memfit):
    out = tmp_path / "run"
    result = warm_memfit.run("train", "--dataset", chats, "--seq-len", "256", flag, "--output-dir", out, *RUN)
    assert result.returncode == 0, result.stderr
    assert sum(line.startswith(said) for line in result.stderr.splitlines()) == 1, result.stderr
    start = start_record(out)
    assert start["seq_len"] == 256 and start["data"]["samples_kept"] == kept


def test_plain_text_keeps_256(text_file, tmp_path, warm_memfit):
    out = tmp_path / "run"  # the built-in tiny model: more positions than 256, so nothing caps the default
    result = warm_memfit.run("train", "--dataset", text_file, "--output-dir", out, *RUN)
    assert result.returncode == 0, result.stderr
    assert start_record(out)["seq_len"] == 256
    assert "from the data" not in result.stderr


def test_memfit_data_says_the_drop_on_its_own_line_and_the_length_that_keeps_every_sample(chats, warm_memfit):
    result = warm_memfit.run("data", chats, "--seq-len", "256", "--show", "0")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    dropped = [line for line in lines if line.startswith("DROPPED: ")]
    assert len(dropped) == 1 and "34 of 50 samples" in dropped[0] and "target tokens" in dropped[0], result.stdout
    assert "suggested: --seq-len 704 keeps every sample whole (the longest has 681 tokens)" in lines
    chosen = warm_memfit.run("data", chats, "--show", "0")
    assert "seq-len 704 from the data (longest sample 681 tokens; keeps 50 of 50 samples)" in chosen.stdout.splitlines()

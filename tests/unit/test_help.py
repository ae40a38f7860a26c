"""The help pages: wrapped to the terminal (at most 100 columns), choices and sizes shown, no "[default: None]",
a short `--help` that ends with how to see the rest, a `--help-all` that lists every flag the parser takes,
one section's help, a suggestion for an unknown section, and no torch imported to print any of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from memfit.cli.data import DataOptions
from memfit.cli.estimate import EstimateOptions
from memfit.cli.find_batch_size import FindBatchSizeOptions
from memfit.cli.generate import GenerateOptions
from memfit.cli.main import COMMANDS, main
from memfit.cli.merge import MergeOptions
from memfit.cli.plan import PlanOptions
from memfit.cli.profile import ProfileOptions
from memfit.config import OPTIMIZERS, SECTIONS
from memfit.config_loading import known_names

# What each command's parser takes besides the training flags (memfit.cli.flags.parse_command_line's extras,
# or the hand-parsed options of report and compare), and whether it takes the training flags.
PARSERS: dict[str, tuple[list[type], bool, list[str]]] = {
    "train": ([], True, []),
    "estimate": ([EstimateOptions], True, []),
    "plan": ([PlanOptions], True, []),
    "profile": ([ProfileOptions], True, []),
    "find-batch-size": ([FindBatchSizeOptions], True, []),
    "data": ([DataOptions], True, []),
    "merge": ([MergeOptions], False, []),
    "generate": ([GenerateOptions], False, []),
    "report": ([], False, ["-o", "--output"]),
    "compare": ([], False, ["-o", "--output"]),
    "presets": ([], False, []),
}
PAGES = (["--help"], ["--help-all"])

# Every help page of every command in a fresh interpreter whose stdout is a pipe (not a terminal), COLUMNS unset:
# the pages as JSON, and whether torch was imported to make them.
ALL_PAGES_SCRIPT = """
import contextlib, io, json, sys
from memfit.cli.main import COMMANDS, main
pages = {}
for argv in [["--help"]] + [[command, page] for command in COMMANDS for page in ("--help", "--help-all")]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    pages[" ".join(argv)] = (code, out.getvalue())
print(json.dumps({"pages": pages, "torch": "torch" in sys.modules}))
"""


def page(argv: list[str], capsys) -> str:
    assert main(argv) == 0, argv
    return capsys.readouterr().out


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.fixture
def columns(monkeypatch):
    """Set COLUMNS for the pages made in this process (else they follow the terminal pytest runs in)."""
    return lambda width: monkeypatch.setenv("COLUMNS", str(width))


@pytest.fixture(scope="module")
def pages_without_columns():
    env = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    result = subprocess.run([sys.executable, "-c", ALL_PAGES_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_every_page_fits_100_columns_when_not_a_terminal(pages_without_columns):
    """COLUMNS unset and stdout not a terminal: 100 columns, used (the long docstrings reach it) and never passed."""
    pages = pages_without_columns["pages"]
    assert set(pages) == {"--help"} | {f"{c} {p}" for c in COMMANDS for p in ("--help", "--help-all")}
    for argv, (code, text) in pages.items():
        assert code == 0, argv
        too_wide = [line for line in text.splitlines() if len(line) > 100]
        assert not too_wide, f"memfit {argv}: {too_wide[:3]}"
    assert widest(pages["train --help-all"][1]) > 90


def test_help_imports_no_torch(pages_without_columns):
    """Every page is made from the dataclasses and their docstrings: about 0.2 s, no torch (seconds to import)."""
    assert pages_without_columns["torch"] is False


@pytest.mark.parametrize("width", [80, 60])
def test_every_page_wraps_to_COLUMNS(width, columns, capsys):
    columns(width)
    for command in COMMANDS:
        for flags in PAGES:
            text = page([command, *flags], capsys)
            assert widest(text) <= width, (command, flags, [line for line in text.splitlines() if len(line) > width])
    assert widest(page(["--help"], capsys)) <= width
    assert widest(page(["train", "--help-all"], capsys)) > width - 10  # wrapped to the width, not far inside it


def test_a_wide_terminal_still_gets_100_columns(columns, capsys):
    columns(250)
    assert widest(page(["train", "--help-all"], capsys)) <= 100


def _entry(text: str, flag: str) -> str:
    """The text of one flag's entry in a page: from its line up to the next flag's."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"  {re.escape(flag)}(?![\w-])", line))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"  \S", lines[i]) or not lines[i].strip()),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_optimizer_lists_its_choices(columns, capsys):
    columns(100)
    for argv in (["train", "--help-all"], ["train", "--help", "optimizer"], ["plan", "--help-all"]):
        entry = _entry(page(argv, capsys), "--optimizer")
        missing = [name for name in OPTIMIZERS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", entry)]
        assert not missing, (argv, missing, entry)
        assert "adamw (default)" in entry


def test_sizes_say_what_they_take(columns, capsys):
    columns(100)
    text = page(["train", "--help-all"], capsys)
    for flag in ("--memory-cap", "--memory-budget"):
        entry = _entry(text, flag)
        assert f"{flag} SIZE" in entry and "16GiB" in entry, entry


def test_no_default_none(columns, capsys):
    """A field whose default is None says nothing about it, or its docstring says what None means."""
    columns(100)
    for command in COMMANDS:
        for flags in PAGES:
            text = page([command, *flags], capsys)
            assert not re.search(r"[Dd]efault: None\b", text), (command, flags)  # (the choice 'none' is a value)
            assert "[default:" not in text, (command, flags)


FIRST_FLAGS = ("--model", "--dataset", "--output-dir", "--seq-len", "--batch-size", "--gradient-accumulation-steps",
               "--max-steps", "--epochs", "--learning-rate", "--lora-r", "--quantize", "--precision",
               "--gradient-checkpointing", "--memory-budget", "--gpu", "--task", "--config", "--resume")


def test_short_help_is_short_and_says_how_to_see_the_rest(columns, capsys):
    columns(100)
    text = page(["train", "--help"], capsys)
    assert len(text.splitlines()) <= 42, text  # about 40: usage, summary, the flags to start with, the rest
    assert "memfit train --help-all" in text
    for section in SECTIONS:
        assert section in text.split("--help-all")[-1], section  # the sections --help SECTION takes are listed
    for flag in FIRST_FLAGS:
        assert re.search(rf"^  (--\S+, )?{flag}(?![\w-])", text, re.MULTILINE), flag
    for command, (_, train_flags, _) in PARSERS.items():
        text = page([command, "--help"], capsys)
        assert len(text.splitlines()) <= 45, (command, len(text.splitlines()))
        if train_flags:
            assert f"memfit {command} --help-all" in text, command


def _listed(text: str, flag: str) -> bool:
    text = text.replace("--[no-]", "--")  # --[no-]trial lists --trial and --no-trial
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@pytest.mark.parametrize("command", list(PARSERS))
def test_help_all_lists_every_flag_the_parser_accepts(command, columns, capsys):
    """Training fields, other trainers' names (aliases, switches, accepted settings), the command's own options."""
    columns(80)
    extras, train_flags, hand_parsed = PARSERS[command]
    names = known_names() if train_flags else []
    names += [field for cls in extras for field in cls.__dataclass_fields__]
    flags = [f"--{name.replace('_', '-')}" for name in names] + hand_parsed + ["--help", "--help-all"]
    flags += ["--config"] if train_flags else []
    text = page([command, "--help-all"], capsys)
    missing = [flag for flag in flags if not _listed(text, flag)]
    assert not missing, missing


def test_help_all_has_a_title_per_section(columns, capsys):
    columns(100)
    text = page(["train", "--help-all"], capsys)
    for section in SECTIONS:
        assert re.search(rf"^{section}: \S", text, re.MULTILINE), section


@pytest.mark.parametrize("argv", [["train", "--help", "memory"], ["train", "--help-memory"],
                                  ["help", "train", "memory"]])
def test_one_section(argv, columns, capsys):
    columns(100)
    text = page(argv, capsys)
    assert re.search(r"^memory: ", text, re.MULTILINE)
    entries = re.findall(r"^  (--[\w-]+)", text, re.MULTILINE)
    assert "--gradient-checkpointing" in entries and "--memory-cap" in entries
    assert "--optimizer" not in entries and "--lora-r" not in entries
    assert len(text.splitlines()) < len(page(["train", "--help-all"], capsys).splitlines()) / 3


@pytest.mark.parametrize("command", ["train", "data", "merge", "report"])  # training flags, own options, neither
def test_every_listed_section_has_a_page(command, columns, capsys):
    columns(100)
    listed = page([command, "--help", "general"], capsys)
    sections = re.search(r"one section's flags: ([a-z, ]+)\.", " ".join(listed.split())).group(1).split(", ")
    for section in sections:
        assert page([command, "--help", section], capsys).count("\n") > 2, (command, section)
    assert ("options" in sections) == bool(PARSERS[command][0])


@pytest.mark.parametrize("argv, closest", [(["train", "--help", "memroy"], "memory"),
                                           (["estimate", "--help-optimiser"], "optimizer"),
                                           (["train", "--help", "eval"], "evaluation")])
def test_unknown_section_names_the_closest(argv, closest, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert f"did you mean {closest}?" in lines[0], lines[0]


def test_memfit_help_lists_every_command(columns, capsys):
    columns(80)
    text = page(["--help"], capsys)
    assert widest(text) <= 80
    for command in COMMANDS:
        assert re.search(rf"^  {command} ", text, re.MULTILINE), command
    assert "--help-all" in text

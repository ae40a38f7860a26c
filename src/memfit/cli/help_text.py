"""Help pages of the `memfit` command, wrapped to the terminal and built from the field docstrings.

`memfit COMMAND --help` is short: usage, the summary, the command's own options and the few training
flags a newcomer sets first, then how to see the rest. `--help-all` shows every flag the command
accepts, by section, and `--help SECTION` (or `--help-SECTION`) one section. A flag's text is its
dataclass field's docstring (`memfit.config_sections`, or the command's options class), followed by
what the field's type and metadata say: the choices (the default marked), that a size takes 16GiB,
the default when there is one to show, and the other trainers' names it answers to.

Width: the terminal's (COLUMNS, else the terminal stdout is), at most 100 columns; 100 when stdout is
not a terminal. Only the standard library and memfit's configuration modules are imported: help
never imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

from memfit.config import SECTIONS
from memfit.config_loading import ALIASES, SAME_AS_MEMFIT, SWITCHES, base_type, field_docs
from memfit.errors import UsageError

MAX_WIDTH = 100
MIN_WIDTH = 40  # narrower terminals get 40 columns (and wrap them again themselves)

# `--help SECTION`: what each section of the training flags holds (the key is what --help takes).
SECTION_TITLES = {
    "general": "the configuration file and help",
    "arguments": "what the command takes",
    "options": "this command's own options",
    "model": "the model and how it is loaded",
    "data": "training data: files, formats, chat templates, lengths and packing",
    "optimizer": "optimizer, learning rate and schedule",
    "training": "how long, micro-batch, accumulation and seed",
    "memory": "precision, checkpointing, offload, kernels and memory planning",
    "lora": "LoRA adapters and quantized base weights",
    "output": "output directory, checkpoints, preemption, resume and logging",
    "distributed": "several GPUs under torchrun: DDP, FSDP, DeepSpeed",
    "evaluation": "evaluation data and when to evaluate",
    "task": "what is learned: next token, masked tokens, classification, regression, preferences, rewards",
    "rl": "--task grpo: rewards, generation and the policy-gradient objective (TRL's names)",
    "compatibility": "other trainers' settings accepted as they are",
}

# Placeholders of a flag's value, by field name; else by type (see _metavar).
METAVARS = {
    "model": "MODEL", "tokenizer": "TOKENIZER", "dataset": "DATA", "eval_dataset": "DATA", "output_dir": "DIR",
    "cache_dir": "DIR", "log_file": "FILE", "resume": "auto|DIR", "gpu": "GPU", "deepspeed": "FILE.json",
    "chat_template": "TEMPLATE", "label_table": "FILE", "plot": "FILE.png", "snapshot": "FILE.pickle",
    "messages": "FILE.json", "output": "DIR", "prompt": "TEXT", "report_to": "TRACKERS", "lora_targets": "MODULES",
    "optim_target_modules": "MODULES", "preempt_signals": "SIGNALS", "label_names": "NAMES",
}
# Aliases shown beside the field's own name (in every page) rather than under "Other names".
SHOWN_ALIASES = {"lr": ("learning_rate",)}
# Added to a size field's text (metadata {"size": True}: memfit.units.parse_size reads it).
SIZE_NOTE = "Sizes: 16GiB, 24GB, 512MiB or a number of bytes."
NBSP = "\xa0"  # joins what a line must not split ("Default: off"); a space once wrapped


def terminal_width() -> int:
    """Columns to wrap to: COLUMNS, else the terminal's, else 100; never more than 100 (nor under 40)."""
    return max(MIN_WIDTH, min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns))


@dataclass
class Entry:
    """One row of a help page's table: `names` in the left column, `text` wrapped to its right.

    `shorter`: texts tried in turn, in the short help, while the text takes more than two lines.
    """

    names: str
    text: str
    shorter: tuple[str, ...] = ()


@dataclass
class Section:
    """A group of entries under a heading: "key: what it holds" (the key is what --help SECTION takes)."""

    key: str
    entries: list[Entry]
    note: str = ""  # a paragraph under the heading
    title: str = ""  # a heading of its own instead

    @property
    def heading(self) -> str:
        if self.title:
            return self.title
        title = SECTION_TITLES.get(self.key)
        return f"{self.key}: {title}" if title else f"{self.key}:"


@dataclass
class CommandHelp:
    """What the help pages of one subcommand are made of.

    `options`: the command's own options classes (documented dataclasses); `train_flags`: whether it takes
    every training flag too; `first`: the training flags its short help shows (field names, or "config");
    `arguments`: (names, text) of what is not a dataclass field (positional arguments, hand-parsed options).
    """

    command: str
    usage: str
    summary: str
    options: tuple[type, ...] = ()
    train_flags: bool = True
    first: tuple[str, ...] = ()
    arguments: tuple[tuple[str, str], ...] = ()
    first_title: str = "the flags to start with:"


# --- one flag --------------------------------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _metavar(name: str, kind: type, f: dataclasses.Field) -> str:
    if name in METAVARS:
        return METAVARS[name]
    if f.metadata.get("size"):
        return "SIZE"
    if f.metadata.get("choices"):
        return "CHOICE"
    if kind is int:
        return "N"
    if kind is float:
        return "X"
    if name.endswith(("_field", "_fields")):
        return "COLUMN"
    return "TEXT"


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def sentences(text: str) -> list[str]:
    """The docstring's sentences (a full stop followed by a capital; "e.g. 16GiB" ends none)."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z'\"])", text.strip())


def short_doc(text: str) -> str:
    """The short help's form of a docstring: its first sentence, and the one saying the default if another."""
    parts = sentences(text)
    said = [p for p in parts[1:] if p.startswith("Default")][:1]
    return " ".join(parts[:1] + [brief(p) for p in said])


def brief(text: str) -> str:
    """Text without its asides in parentheses (the short help's, where the full text takes too many lines)."""
    sentence = text
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", sentence)
        if shorter == sentence:
            return re.sub(r"\s+([,.;:])(?=\s|$)", r"\1", shorter)
        sentence = shorter


def _other_names(name: str, hidden: Iterable[str], doc: str) -> str:
    """'Other names: --learning-rate.' and the switches that set this field (those the docstring does not name)."""
    hidden = set(hidden) | set(SHOWN_ALIASES.get(name, ()))
    aliases = [alias for alias, target in ALIASES.items() if target == name and alias not in hidden]
    switches = [(switch, on, off) for switch, (target, on, off) in SWITCHES.items() if target == name
                and switch not in hidden]
    # what the docstring names already (chunked_training's "--use-chunked-training") is not said twice
    aliases = [_flag(alias) for alias in aliases if not _mentions(doc, _flag(alias))]
    switches = [f"{_flag(switch)} ({on}; --no-{switch.replace('_', '-')}: {off})"
                for switch, on, off in switches if not _mentions(doc, _flag(switch))]
    parts = []
    if aliases:
        parts.append(f"Other names: {', '.join(aliases)}.")
    if switches:
        parts.append(f"Switches: {', '.join(switches)}.")
    return " ".join(parts)


def field_entry(name: str, owner: type, f: dataclasses.Field, doc: str, short: bool = False,
                hidden_aliases: Iterable[str] = ()) -> Entry:
    """A field as a help entry: its flag, a placeholder of its value, its docstring and what its type adds."""
    from memfit.cli.flags import BARE_VALUES

    kind = _kind(f, owner)
    default = f.default if f.default is not dataclasses.MISSING else None
    flag = _flag(name)
    names = ", ".join([flag, *map(_flag, SHOWN_ALIASES.get(name, ()))])
    if kind is bool:
        names = f"--[no-]{name.replace('_', '-')}" if default else names
    elif name in BARE_VALUES:
        names += f" [{_metavar(name, kind, f)}]"
    else:
        names += f" {_metavar(name, kind, f)}"
    text = short_doc(doc) if short else doc.strip()
    notes = []
    choices = f.metadata.get("choices")
    if choices:
        if all(_mentions(text, str(choice)) for choice in choices):
            notes.append(f"Default:{NBSP}{default}." if default is not None else "")
        else:
            listed = ", ".join(f"{c} (default)" if c == default else str(c) for c in choices)
            notes.append(f"Choices: {listed}.")
    elif kind is bool:
        notes.append(f"Default:{NBSP}on." if default else "")
    elif default is not None and default != "":
        notes.append(f"Default:{NBSP}{_show(default)}.")
    if name in BARE_VALUES and not short and f"--no-{name.replace('_', '-')}" not in text:
        on, off = BARE_VALUES[name]
        notes.append(f"Alone, {flag} means {on}; --no-{name.replace('_', '-')}: {off}.")
    if f.metadata.get("size"):
        notes.append(SIZE_NOTE)
    if not short:
        notes.append(_other_names(name, hidden_aliases, text))
        return Entry(names, " ".join(part for part in [text, *notes] if part))
    # Shorter forms for the short help: without the asides; with the default's sentence up to its first ';'; the
    # first sentence alone.
    parts = sentences(brief(text))
    cut = " ".join([parts[0], *(p.split(";")[0].rstrip(".") + "." for p in parts[1:])])
    return Entry(names, " ".join(part for part in [text, *notes] if part),
                 tuple(" ".join(part for part in [shorter, *notes] if part) for shorter in (brief(text), cut, parts[0])))


@functools.cache
def _hints(cls: type) -> dict[str, type]:
    return {f.name: base_type(f, cls) for f in dataclasses.fields(cls)}


def _kind(f: dataclasses.Field, owner: type) -> type:
    """The field's type without None (int for `int | None`), as memfit.config_loading.base_type, once per class."""
    return _hints(owner)[f.name]


@functools.cache
def _docs(cls: type) -> dict[str, str]:
    return field_docs(cls)  # reads the class's source: once per class and process


def class_entries(cls: type, short: bool = False, hidden_aliases: Iterable[str] = ()) -> list[Entry]:
    docs = _docs(cls)
    return [field_entry(f.name, cls, f, docs.get(f.name, ""), short, hidden_aliases) for f in dataclasses.fields(cls)]


# --- sections of a command -------------------------------------------------------------------------------------------


def _general(help: CommandHelp) -> Section:
    entries = []
    if help.train_flags:
        entries.append(Entry("--config FILE.yaml", "Read the settings from a YAML file first: the flags' names with "
                                                   "underscores (seq_len: 512), flat or under the section names; flags "
                                                   "given too override it.",
                             ("Settings from a YAML file (seq_len: 512); flags given too override it.",)))
    sections = ", ".join(section_keys(help))
    entries += [
        Entry("-h, --help [SECTION]", f"The short help, or one section's flags: {sections}. Also --help-SECTION."),
        Entry("--help-all", "Every flag, by section."),
    ]
    note = "A switch (a flag without a value) is turned off with --no-NAME." if help.train_flags else ""
    return Section("general", entries, note)


def _compatibility() -> Section:
    def accepted(name: str, allowed: tuple) -> str:
        if allowed == (True,):
            return _flag(name)  # a bare switch
        values = [str(v) for v in allowed if isinstance(v, str)]
        return f"{_flag(name)} {' or '.join(values)}" if values else f"{_flag(name)} (empty, in a YAML file)"

    listed = ", ".join(accepted(name, allowed) for name, allowed in SAME_AS_MEMFIT.items())
    note = (f"The Hugging Face Trainer's settings whose value means what memfit always does are accepted and change "
            f"nothing: {listed}. Another value is refused. Other trainers' names of memfit's flags are listed "
            f"under each flag (Other names).")
    return Section("compatibility", [], note)


def sections(help: CommandHelp) -> list[Section]:
    """Every section of the command's --help-all, in order."""
    own = {f.name for cls in help.options for f in dataclasses.fields(cls)}
    result = []
    if help.arguments:
        result.append(Section("arguments", [Entry(names, text) for names, text in help.arguments]))
    if help.options:
        result.append(Section("options", [e for cls in help.options for e in class_entries(cls)]))
    if help.train_flags:
        # A command's own option wins over a training alias of the same name (profile's --steps): not listed there.
        result += [Section(key, class_entries(cls, hidden_aliases=own)) for key, cls in SECTIONS.items()]
        result.append(_compatibility())
    result.append(_general(help))
    return result


def section_keys(help: CommandHelp) -> list[str]:
    keys = ["arguments"] if help.arguments else []
    keys += ["options"] if help.options else []
    keys += [*SECTIONS, "compatibility"] if help.train_flags else []
    return [*keys, "general"]


# --- rendering -------------------------------------------------------------------------------------------------------


def _paragraphs(text: str, width: int, indent: str = "") -> list[str]:
    """Text wrapped to `width`: blank lines separate paragraphs, single newlines are spaces."""
    lines: list[str] = []
    for number, paragraph in enumerate(p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()):
        if number:
            lines.append("")
        lines += _wrap(" ".join(paragraph.split()), width, indent, indent)
    return lines


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    lines = textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
    return [line.replace(NBSP, " ") for line in lines] or [first]


def _column(entries: Iterable[Entry], width: int) -> int:
    """Where the text column starts: after the longest names, at most 24 columns in (27 at 100 columns; longer
    names get a line of their own, as argparse does), so that the text keeps most of the width."""
    longest = max((len(e.names) for e in entries), default=0)
    return min(longest + 4, max(min(24, width // 3), int(width * 0.27)))


def render_entries(entries: list[Entry], width: int, column: int, short: bool = False) -> list[str]:
    lines = []
    for entry in entries:
        names = "  " + entry.names
        text = entry.text
        for shorter in entry.shorter if short else ():
            if len(_wrap(text, width, " " * column, " " * column)) <= 2:
                break
            text = shorter
        if len(names) + 2 <= column:
            lines += _wrap(text, width, names.ljust(column), " " * column)
        else:  # the names take the whole line, the text starts under the column
            lines += _wrap(entry.names, width, "  ", "      ")
            lines += _wrap(text, width, " " * column, " " * column) if text else []
    return lines


def render_sections(parts: list[Section], width: int, short: bool = False) -> list[str]:
    column = _column((e for s in parts for e in s.entries), width)
    lines: list[str] = []
    for section in parts:
        lines += ["", *_wrap(section.heading, width, "", "  ")]
        if section.note:
            lines += _paragraphs(section.note, width, "  ")
        lines += render_entries(section.entries, width, column, short)
    return lines


def _head(help: CommandHelp, width: int) -> list[str]:
    return [*_wrap(f"usage: {help.usage}", width, "", "        "), "", *_paragraphs(help.summary, width)]


def full_help(help: CommandHelp, width: int | None = None) -> str:
    """--help-all: every flag the command takes, by section."""
    width = width or terminal_width()
    return "\n".join(_head(help, width) + render_sections(sections(help), width))


def section_help(help: CommandHelp, key: str, width: int | None = None) -> str:
    """--help SECTION: the usage and that section's flags."""
    width = width or terminal_width()
    chosen = [s for s in sections(help) if s.key == key]
    return "\n".join(_wrap(f"usage: {help.usage}", width, "", "        ") + render_sections(chosen, width))


def short_help(help: CommandHelp, width: int | None = None) -> str:
    """--help: usage, summary, the command's own options, the first training flags, and how to see the rest."""
    width = width or terminal_width()
    everything = sections(help)
    parts = [s for s in everything if s.key in ("arguments", "options")]
    if help.first:
        index = {f.name: (cls, f) for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
        general = everything[-1].entries
        entries = []
        for name in help.first:
            if name == "config":
                entries.append(general[0])
            else:
                cls, f = index[name]
                entries.append(field_entry(name, cls, f, _docs(cls).get(name, ""), short=True))
        parts.append(Section("first", entries, title=help.first_title))
    lines = _head(help, width)
    lines += render_sections(parts, width, short=True)
    shown = sum(len(s.entries) for s in parts if s.key != "arguments")
    total = sum(len(s.entries) for s in everything if s.key not in ("arguments", "general"))
    if shown < total:
        command = f"memfit {help.command.split()[0]}"
        keys = ", ".join(section_keys(help))
        lines += [""] + _paragraphs(
            f"All {total} flags: {command} --help-all; a section: --help SECTION ({keys}).", width)
    return "\n".join(lines)


def requested(argv: list[str]) -> tuple[bool, str | None]:
    """Whether argv asks for help, and which page: None (short), 'all', or a section name."""
    for index, token in enumerate(argv):
        if token in ("-h", "--help"):
            following = argv[index + 1] if index + 1 < len(argv) else ""
            # a word names a section; a path (runs/x, data.jsonl) is the command's argument
            return True, following if re.fullmatch(r"[A-Za-z][A-Za-z_-]*", following) else None
        if token.startswith("--help="):
            return True, token.partition("=")[2] or None
        if token.startswith("--help-"):
            return True, token.removeprefix("--help-") or None
    return False, None


def _closest(word: str, keys: list[str]) -> str:
    from memfit.config import field_index
    from memfit.config_loading import canonical_name

    flag_name = canonical_name(word)
    if flag_name in field_index():
        return f"did you mean {field_index()[flag_name][0]} (the section of {_flag(flag_name)})? "
    starting = [k for k in keys if k.startswith(word.lower())]
    close = starting or difflib.get_close_matches(word.lower(), keys, n=1, cutoff=0.4)
    return f"did you mean {close[0]}? " if close else ""


def answer_help(argv: list[str], help: CommandHelp) -> int | None:
    """Print the help argv asks for and return the exit code 0; None when argv asks for none.

    Raises UsageError (one line, exit 2) for an unknown section, naming the closest one.
    """
    wanted, page = requested(argv)
    if not wanted:
        return None
    keys = section_keys(help)
    if page is None:
        text = short_help(help)
    elif page.lower() == "all":
        text = full_help(help)
    elif page.lower() in keys:
        text = section_help(help, page.lower())
    else:
        raise UsageError(f"no help section {page!r}: {_closest(page, [*keys, 'all'])}sections: {', '.join(keys)}, all")
    sys.stdout.write(text + "\n")
    return 0


def main_help(commands: dict[str, tuple[str, str]], width: int | None = None) -> str:
    """`memfit --help`: the commands, one line each, wrapped."""
    width = width or terminal_width()
    lines = _wrap("usage: memfit COMMAND [ARGUMENTS] [--FLAG VALUE ...]", width, "", "        ") + [""]
    lines += _paragraphs(
        "Train and fine-tune causal language models within the memory you have: estimate what a run needs, plan "
        "the fastest setup that fits, train, and read what happened. With no command: memfit train (the built-in "
        "tiny model on the bundled corpus, about a minute on 2 CPU cores).", width)
    section = Section("commands", [Entry(name, summary) for name, (_, summary) in commands.items()])
    lines += render_sections([section], width)
    lines += [""] + _paragraphs(
        "memfit COMMAND --help: what a command does and the flags to start with; memfit COMMAND --help-all: every "
        "flag it takes.", width)
    return "\n".join(lines)

"""Command-line flags: `--name value`, `--name=value`, `--switch` / `--no-switch`.

One parser serves every subcommand. Training flags come from the sections of
`memfit.config`; a subcommand adds its own options as a small dataclass with a
docstring per field (for example `ProfileOptions`); memfit.cli.help_text makes the
help pages from the same docstrings. Unknown flags are errors that
suggest the closest valid one, and every problem is reported at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.config import SECTIONS, TrainConfig, field_index
from memfit.config_loading import (
    SWITCHES,
    base_type,
    canonical_name,
    convert_bool,
    is_optional,
    known_names,
    load_config,
    suggest,
)
from memfit.errors import UsageError

# Choice fields that may also be given bare, as AI-OS and DNALLM do (`--gradient-checkpointing`).
BARE_VALUES = {"gradient_checkpointing": ("full", "off"), "packing": ("auto", "off")}


def _is_bool_field(name: str, owner: type, f: dataclasses.Field) -> bool:
    return base_type(f, owner) is bool


def _extra_fields(extras: list[type]) -> dict[str, tuple[type, dataclasses.Field]]:
    return {f.name: (cls, f) for cls in extras for f in dataclasses.fields(cls)}


def _takes_no_value(name: str, extras: dict) -> bool:
    if name in SWITCHES:
        return True
    if name in extras:
        cls, f = extras[name]
        return base_type(f, cls) is bool
    index = field_index()
    if name in index:
        section, f = index[name]
        return _is_bool_field(name, SECTIONS[section], f)
    return False


def split_argv(argv: list[str], extras: dict) -> tuple[list[tuple[str, Any]], list[str]]:
    """argv -> [(name, raw value)] in order, plus problems. Names keep the user's spelling."""
    settings: list[tuple[str, Any]] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            problems.append(f"unexpected argument {token!r}: options are written --name value")
            continue
        key, has_value, value = token[2:].partition("=")
        name = canonical_name(key)
        negated = False
        if name.startswith("no_") and not has_value:
            positive = name[3:]
            if canonical_name(positive) in BARE_VALUES or _takes_no_value(canonical_name(positive), extras):
                name, negated = canonical_name(positive), True
                key = key[3:]
        if negated:
            settings.append((key, BARE_VALUES[name][1] if name in BARE_VALUES else False))
            continue
        if has_value:
            settings.append((key, value))
            continue
        next_is_value = i < len(argv) and not argv[i].startswith("--")
        if name in BARE_VALUES:
            if next_is_value:
                settings.append((key, argv[i]))
                i += 1
            else:
                settings.append((key, BARE_VALUES[name][0]))
            continue
        if _takes_no_value(name, extras):
            if next_is_value and argv[i].lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
                settings.append((key, argv[i]))
                i += 1
            else:
                settings.append((key, True))
            continue
        if not next_is_value:
            if name in field_index() or name in extras:
                problems.append(f"--{key} needs a value")
            else:
                settings.append((key, True))  # reported as unknown below
            continue
        settings.append((key, argv[i]))
        i += 1
    return _join_repeated(settings), problems


REPEATABLE = ("reward_function",)
"""Flags that may be given several times: their values are joined with commas into the one setting."""


def _join_repeated(settings: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each REPEATABLE flag's values as one setting at its first place (`--reward-function a --reward-function b`
    is `--reward-function a,b`); any other flag given twice keeps both (the last one wins later, as before)."""
    joined: list[tuple[str, Any]] = []
    first_at: dict[str, int] = {}
    for key, value in settings:
        name = canonical_name(key)
        if name in REPEATABLE and name in first_at and isinstance(value, str):
            place = first_at[name]
            joined[place] = (joined[place][0], f"{joined[place][1]},{value}")
            continue
        if name in REPEATABLE:
            first_at[name] = len(joined)
        joined.append((key, value))
    return joined


def accepted_flags(extras: list[type] | None = None, train_flags: bool = True) -> list[str]:
    """Every flag name the parser takes for a command (--help-all lists each), besides --no-SWITCH forms."""
    names = known_names() if train_flags else []
    names += [f.name for cls in extras or [] for f in dataclasses.fields(cls)]
    general = ["--config", "--help", "--help-all"] if train_flags else ["--help", "--help-all"]
    return [f"--{n.replace('_', '-')}" for n in names] + general


def parse_command_line(
    argv: list[str], extras: list[type] | None = None, train_flags: bool = True
) -> tuple[TrainConfig, dict[type, Any]]:
    """Parse argv into a TrainConfig (file + flags) and one instance per extra options class.

    `--config FILE` reads a YAML file first; flags given on the command line override it.
    Raises UsageError naming every bad flag, with a suggestion for unknown ones.
    """
    extras = extras or []
    extra_fields = _extra_fields(extras)
    settings, problems = split_argv(argv, extra_fields)
    config_path = None
    train_settings: list[tuple[str, Any]] = []
    extra_values: dict[type, dict[str, Any]] = {cls: {} for cls in extras}
    valid = accepted_flags(extras, train_flags)
    for key, raw in settings:
        name = key.replace("-", "_")
        if name not in extra_fields:  # a subcommand's own option wins over a training alias (--steps)
            name = canonical_name(key)
        if name == "config":
            config_path = raw
        elif name in extra_fields:
            cls, f = extra_fields[name]
            try:
                extra_values[cls][name] = _convert_extra(name, raw, cls, f)
            except UsageError as error:
                problems.append(str(error))
        elif train_flags and (name in field_index() or name in SWITCHES):
            train_settings.append((key, raw))
        else:
            problems.append(f"unknown option --{key}{suggest('--' + key, valid)}")
    config = None
    try:
        config = load_config(config_path, train_settings)
    except UsageError as error:
        problems.append(str(error))
    if problems:
        raise UsageError("; ".join(problems))
    instances = {cls: cls(**values) for cls, values in extra_values.items()}
    return config, instances


def _convert_extra(name: str, raw: Any, cls: type, f: dataclasses.Field) -> Any:
    kind = base_type(f, cls)
    label = f"--{name.replace('_', '-')}"
    if raw is None and is_optional(f, cls):
        return None
    if kind is bool:
        return convert_bool(raw, label)
    if f.metadata.get("size"):
        from memfit.units import parse_size

        return parse_size(raw, label)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{label} takes a {kind.__name__}, got {raw!r}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"{label} must be one of {', '.join(map(str, choices))}; got {raw!r}{suggest(str(raw), map(str, choices))}")
    return value

"""Reading a run's settings: YAML files and command-line values -> a validated `TrainConfig`.

Names may use dashes or underscores and the names other trainers use (AI-OS's
`--window-size`, the Hugging Face Trainer's `per_device_train_batch_size` and
`optim: adamw_8bit`); values are
converted by the type of the field they set; every problem is collected and raised
once, naming the flag or key and, for unknown names, the closest valid one.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import typing
from pathlib import Path
from typing import Any

from memfit.config import SECTIONS, TrainConfig, field_index
from memfit.errors import UsageError
from memfit.units import parse_size

# Section names other tools use in their YAML files; their keys are read as flat keys.
SECTION_ALIASES = ("training_args", "args", "train", "optim", "finetune")
# DNALLM's fine-tuning YAML: names that mean something else inside one of its sections, and a section for a trainer's
# predictions that a training run has no use for (ignored, with one line saying so).
SECTION_KEY_ALIASES: dict[str, dict[str, str]] = {
    "lora": {"r": "lora_r", "target_modules": "lora_targets", "alpha": "lora_alpha", "dropout": "lora_dropout"},
    "task": {"task_type": "task"},
}
IGNORED_SECTIONS = ("inference",)
# The Trainer's settings whose value here means what memfit always does: accepted and dropped; another value is refused.
SAME_AS_MEMFIT: dict[str, tuple[Any, ...]] = {
    "logging_strategy": ("steps",),
    "save_strategy": ("steps",),
    "save_safetensors": (True,),
    "lr_scheduler_kwargs": (None, {}),
    "metric_for_best_model": ("eval_loss", "loss"),
}

# Names of the Hugging Face Trainer (and of DNALLM, which passes them on), AI-OS and Axolotl -> memfit name.
ALIASES: dict[str, str] = {
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "window_size": "seq_len",
    "max_seq_length": "seq_len",
    "dataset_file": "dataset",
    "model_name_or_path": "model",
    "learning_rate": "lr",
    "optim": "optimizer",
    "steps": "max_steps",
    "num_train_epochs": "epochs",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "lr_scheduler_type": "lr_schedule",
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_epsilon": "eps",
    "output_directory": "output_dir",
    "resume_from_checkpoint": "resume",
    "attn_implementation": "attention",
    "torch_dtype": "dtype",
    "max_length": "seq_len",  # TRL's SFTConfig
    "dataset_text_field": "text_field",  # TRL's SFTConfig
    "use_chunked_training": "chunked_training",  # AI-OS
    # Evaluation: the Hugging Face Trainer / TRL (eval_steps, per_device_eval_batch_size, eval_strategy,
    # load_best_model_at_end: memfit keeps the best model in best/), Axolotl (val_set_size) and LLaMA-Factory (val_size).
    "eval_steps": "eval_every",
    "per_device_eval_batch_size": "eval_batch_size",
    "evaluation_strategy": "eval_strategy",
    "load_best_model_at_end": "save_best",
    "val_set_size": "eval_fraction",
    "val_size": "eval_fraction",
    "sample_packing": "packing",  # Axolotl
    "neat_packing": "packing",  # LLaMA-Factory: packing without attention across samples
    "label_field": "label_fields",
    "task_type": "task",  # DNALLM
    "context_parallel_size": "context_parallel",  # Axolotl
    "cp_size": "context_parallel",  # accelerate's ParallelismConfig
}

# Boolean switches of AI-OS (--amp, --use-8bit-optimizer) and the Hugging Face Trainer (bf16, fp16) -> a memfit value.
SWITCHES: dict[str, tuple[str, Any, Any]] = {
    # name: (memfit field, value when true, value when false)
    "amp": ("precision", "amp", "fp32"),
    "use_8bit_optimizer": ("optimizer", "adamw-8bit", "adamw"),
    "bf16": ("precision", "bf16", "fp32"),
    "fp16": ("precision", "fp16", "fp32"),
    # Loss on the answers only (TRL's SFTConfig) or on every token (Axolotl, LLaMA-Factory, memfit's --train-on-prompt).
    "completion_only_loss": ("train_on", "assistant", "all"),
    "assistant_only_loss": ("train_on", "assistant", "all"),
    "train_on_inputs": ("train_on", "all", "assistant"),
    "train_on_prompt": ("train_on", "all", "assistant"),
    "use_qlora": ("quantize", "4bit", "none"),  # DNALLM
}

# Spellings of choice values other tools use -> memfit's spelling.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "optimizer": {
        "adamw_8bit": "adamw-8bit",
        "adamw8bit": "adamw-8bit",
        "adamw_bnb_8bit": "adamw-8bit",
        "paged_adamw_8bit": "paged-adamw-8bit",
        "adamw_torch": "adamw",
        "adamw_torch_fused": "adamw",
        "adamw_hf": "adamw",
        "adam": "adamw",
        # The Trainer's names of GaLore, APOLLO, Adam-mini and torchao's 4-bit AdamW; its layer-wise forms are
        # memfit's --optimizer-in-backward (set it too).
        "galore_adamw": "galore-adamw",
        "galore_adamw_8bit": "galore-adamw-8bit",
        "apollo_adamw": "apollo-adamw",
        "apollo_mini": "apollo-mini",
        "adam_mini": "adam-mini",
        "adamw_torch_4bit": "adamw-4bit",
        "adamw_4bit": "adamw-4bit",
    },
    "gradient_checkpointing": {"true": "full", "false": "off", "on": "full", "none": "off"},
    "precision": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "no": "fp32"},
    "dtype": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "fp32"},
    "lr_schedule": {"cosine_with_warmup": "cosine", "linear_with_warmup": "linear", "constant_with_warmup": "constant"},
    "quantize": {"nf4": "4bit", "int4": "4bit", "int8": "8bit", "off": "none", "false": "none"},
    "sharding": {"off": "none", "fsdp2": "fsdp"},
    # TRL's names of dataset types.
    "dataset_format": {"conversational": "messages", "chat": "messages", "language_modeling": "text", "language-modeling": "text"},
    "eval_strategy": {"none": "no", "off": "no", "false": "no"},
    # Old `packing: true/false` (and TRL's `packing`) keep their meaning: pack the way the data allows, or pad.
    "packing": {"true": "auto", "false": "off", "yes": "auto", "no": "off", "on": "auto", "1": "auto", "0": "off"},
    # DNALLM's task types (multilabel also sets --problem-type multi-label: see flatten_yaml).
    "task": {"binary": "sequence-classification", "multiclass": "sequence-classification",
             "multilabel": "sequence-classification", "token": "token-classification", "mask": "masked-lm",
             "generation": "causal-lm", "classification": "sequence-classification"},
}


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value
    return docs


def base_type(f: dataclasses.Field, owner: type) -> type:
    """The non-None type of a field (int for `int | None`)."""
    hint = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def is_optional(f: dataclasses.Field, owner: type) -> bool:
    hint = typing.get_type_hints(owner)[f.name]
    return type(None) in typing.get_args(hint)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def convert_value(name: str, raw: Any, flag_style: bool = True) -> Any:
    """Convert a raw value (string from the command line, or YAML scalar) for field `name`.

    Raises UsageError with the flag name and the expected form.
    """
    section, f = field_index()[name]
    owner = SECTIONS[section]
    kind = base_type(f, owner)
    label = f"--{name.replace('_', '-')}" if flag_style else name
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null") and is_optional(f, owner)):
        if is_optional(f, owner):
            return None
        raise UsageError(f"{label} needs a value")
    if f.metadata.get("size"):
        return parse_size(raw, label)
    if kind is bool:
        return convert_bool(raw, label)
    if kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise UsageError(f"{label} takes a whole number, got {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{label} takes a whole number, got {raw!r}") from None
    if kind is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{label} takes a number, got {raw!r}") from None
    text = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
    choices = f.metadata.get("choices")
    if choices:
        lowered = text.lower()  # a choice spelled with underscores (TRL's dr_grpo) stays as it is
        text = VALUE_ALIASES.get(name, {}).get(lowered, lowered if lowered in choices else lowered.replace("_", "-"))
        if isinstance(raw, bool):
            text = VALUE_ALIASES.get(name, {}).get(str(raw).lower(), text)
        if text not in choices:
            raise UsageError(f"{label} must be one of {', '.join(choices)}; got {raw!r}{suggest(str(raw), choices)}")
    return text


def suggest(word: str, candidates: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def canonical_name(key: str) -> str:
    """Flag or YAML key -> field name, resolving aliases ('window-size' -> 'seq_len')."""
    key = key.strip().lstrip("-").replace("-", "_")
    return ALIASES.get(key, key)


def known_names() -> list[str]:
    return sorted(set(field_index()) | set(ALIASES) | set(SWITCHES) | set(SAME_AS_MEMFIT))


def apply_setting(values: dict[str, Any], key: str, raw: Any, problems: list[str], flag_style: bool) -> None:
    """Convert one user setting into `values` (flat), appending problems instead of raising."""
    name = canonical_name(key)
    label = f"--{key.lstrip('-').replace('_', '-')}" if flag_style else key
    if name in SAME_AS_MEMFIT:
        if raw not in SAME_AS_MEMFIT[name]:
            allowed = " or ".join(map(str, SAME_AS_MEMFIT[name]))
            problems.append(f"{label} {raw!r} has no memfit equivalent (memfit does what {allowed} means); drop it")
        return
    if name in SWITCHES:
        target, when_true, when_false = SWITCHES[name]
        try:
            on = convert_bool(raw, label)
        except UsageError as error:
            problems.append(str(error))
            return
        values[target] = when_true if on else when_false
        return
    if name not in field_index():
        style = [f"--{n.replace('_', '-')}" for n in known_names()] if flag_style else known_names()
        problems.append(f"unknown {'option' if flag_style else 'key'} {label}{suggest(label, style)}")
        return
    try:
        values[name] = convert_value(name, raw, flag_style)
    except UsageError as error:
        problems.append(str(error))


def convert_bool(raw: Any, label: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UsageError(f"{label} takes true or false, got {raw!r}")


def flatten_yaml(data: dict[str, Any], problems: list[str]) -> list[tuple[str, Any]]:
    """YAML mapping (flat or with sections) -> list of (key, value) settings."""
    settings = []
    for key, value in data.items():
        if key in IGNORED_SECTIONS:
            import logging

            logging.getLogger("memfit").warning("memfit: YAML section %r ignored: it configures predictions, not training", key)
            continue
        if key in SECTION_KEY_ALIASES and isinstance(value, dict):
            renamed = SECTION_KEY_ALIASES[key]
            value = {renamed.get(name, name): setting for name, setting in value.items()}
            if str(value.get("task", "")).lower() == "multilabel" and "problem_type" not in value:
                value["problem_type"] = "multi-label"
        if key in SECTIONS or key in SECTION_ALIASES:
            if key in SECTIONS and not isinstance(value, dict) and canonical_name(key) in field_index():
                settings.append((key, value))  # 'model: gpt2' and 'optimizer: sgd' are fields too
                continue
            if not isinstance(value, dict):
                problems.append(f"section {key!r} must be a mapping of settings")
                continue
            settings.extend(value.items())
        else:
            settings.append((key, value))
    return settings


def read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file {path} does not exist; check the path given to --config")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    return data


def build_config(flat_values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from already-converted flat values, all of them given by the user."""
    return TrainConfig.from_flat(flat_values)


def load_config(
    yaml_path: str | Path | None = None,
    overrides: list[tuple[str, Any]] | dict[str, Any] | None = None,
) -> TrainConfig:
    """Build a TrainConfig from an optional YAML file and overrides (flags win).

    Overrides are (name, raw value) pairs as the command line gives them; names may
    use dashes, underscores or other trainers' aliases. Every problem of both sources is
    reported at once in one UsageError.
    """
    problems: list[str] = []
    values: dict[str, Any] = {}
    if yaml_path is not None:
        for key, raw in flatten_yaml(read_yaml(yaml_path), problems):
            apply_setting(values, str(key), raw, problems, flag_style=False)
    items = overrides.items() if isinstance(overrides, dict) else (overrides or [])
    for key, raw in items:
        apply_setting(values, key, raw, problems, flag_style=True)
    try:
        config = build_config(values)
    except UsageError as error:  # range checks on the values that did convert
        problems.append(str(error))
    if problems:
        raise UsageError("; ".join(problems))
    return config

"""Load the model and tokenizer a run trains: `tiny`, a local directory, a Hugging Face id or a preset.

The name is checked first (models.model_names: one line, no retries, before anything loads).

Weights are read with safetensors (transformers' default); `trust_remote_code` stays off
unless the user asks. LoRA/QLoRA wrapping happens after loading (techniques.lora); a
quantized base is loaded here because bitsandbytes quantizes at load time. `--rope-scale`
changes the model config's RoPE before the model is built (models.rope).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from memfit.checkpoint_files.pretrained import save_pretrained
from memfit.config import TrainConfig
from memfit.errors import UsageError
from memfit.hardware import training_device
from memfit.models.model_names import PRESET_PREFIX, check_model_name
from memfit.models.rope import RopeScaling, apply_rope_scale, can_scale

log = logging.getLogger("memfit")


class AttentionChoice(Protocol):
    """The attention kernel to ask of transformers (techniques.attention.AttentionChoice).

    Declared here, not imported: models sit below techniques and only read these two names.
    """

    implementation: str
    """memfit's name of the kernel: flash, sdpa or eager."""

    @property
    def hf_name(self) -> str: ...

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str
    """Where the model came from, for the log ('built-in tiny', 'directory ./m', ...)."""
    max_positions: int | None
    """Longest sequence the model handles, if it says (after --rope-scale)."""
    rope_scaling: RopeScaling | None = None
    """What --rope-scale changed, or None (the model's own positions)."""
    rope_extendable: bool = False
    """Whether --rope-scale could extend this model's positions (it has RoPE of a type memfit extends)."""

    @property
    def rope_positions(self) -> int | None:
        """The positions --rope-scale multiplies (the model's own), or None when it cannot extend them."""
        if not self.rope_extendable:
            return None
        return self.rope_scaling.positions_before if self.rope_scaling is not None else self.max_positions


def load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if name == "tiny":
        from memfit.models.tiny import byte_tokenizer

        return byte_tokenizer()
    check_model_name(name, flag="--tokenizer")  # the Hub is asked once a process: after the CLI's check, no cost
    name = _hub_id(name)  # a preset's short name means its Hugging Face id, as for the model
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot load a tokenizer from {name!r} ({first[:160]}); pass --tokenizer DIR_OR_ID"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(
    config: TrainConfig, device: torch.device, attention: AttentionChoice, quantization_config=None,
    auto_class: str = "AutoModelForCausalLM", head_config: dict | None = None, on_host: bool = False,
) -> LoadedModel:
    """Build or load the model on `device` in the configured weight dtype.

    `on_host`: leave the model in host memory (bitsandbytes quantizes its linears there), for a staged load
    that moves it to `device` itself (techniques/staged_weights.py).

    `auto_class`: the transformers class of the task's head (memfit.tasks), `head_config` its settings
    (num_labels, id2label, problem_type): a checkpoint without that head gets a new one, seeded by --seed.
    Raises UsageError for a missing path, an unreachable id, or a model without a tokenizer.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    model_class = _HeadClass(getattr(transformers, auto_class), head_config or {})

    hf_logging.disable_progress_bar()  # memfit shows its own progress
    name = config.model.model
    dtype = DTYPES[config.model.dtype]
    torch.manual_seed(config.training.seed)  # the same initial weights for a from-scratch model
    scale, kind = config.model.rope_scale, config.model.rope_scaling
    rope: RopeScaling | None = None
    if name == "tiny":
        from memfit.models.tiny import tiny_config

        hf_config = tiny_config()
        rope = apply_rope_scale(hf_config, scale, kind)
        model = model_class.from_config(hf_config, dtype=dtype,
                                        attn_implementation=_family_kernel(hf_config, attention, device))
        source = "built-in tiny (Llama architecture, random init)"
    elif name.startswith(PRESET_PREFIX):
        # Only on request: 'gpt2' alone means the pretrained weights, not a random model of that shape.
        from memfit.models.presets import is_preset, preset_config

        preset = name.removeprefix(PRESET_PREFIX)
        if not is_preset(preset):
            raise UsageError(f"unknown preset {preset!r}; memfit presets models lists them")
        hf_config = preset_config(preset)
        rope = apply_rope_scale(hf_config, scale, kind)
        # Random weights are made where they train: an 8B preset initialised on the host costs a minute of CPU
        # and a host copy of the whole model. A quantized run is built on the host, saved and reloaded quantized.
        with torch.device(device if quantization_config is None and not on_host else "cpu"):
            model = model_class.from_config(hf_config, dtype=dtype,
                                            attn_implementation=_family_kernel(hf_config, attention, device))
        source = f"preset {preset} (random init)"
    else:
        check_model_name(name)  # a missing path or an unknown id: one line, no retries (the CLI asked already)
        name = _hub_id(name)
        hf_config = None
        if scale is not None:  # without the flag the model loads exactly as before, its config untouched
            hf_config = _pretrained_config(name, config)
            rope = apply_rope_scale(hf_config, scale, kind)
        model = _from_pretrained(name, config, dtype, attention, quantization_config, hf_config, model_class,
                                 on_host=on_host)
        source = f"directory {name}" if Path(name).exists() else f"Hugging Face {name}"
        quantization_config = None  # from_pretrained quantized it while loading
    if quantization_config is not None:
        model = _quantized_copy(model, name, config, dtype, attention, quantization_config, rope, model_class,
                                on_host=on_host)
    elif not on_host:
        model.to(device)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    tokenizer_name = config.model.tokenizer or name
    if tokenizer_name == name and source.startswith("preset"):
        tokenizer_name = "tiny"  # a preset has no tokenizer files: byte tokens fit any vocabulary of 257+
        source += ", byte tokenizer (pass --tokenizer for the real one)"
    tokenizer = load_tokenizer(tokenizer_name, config.model.trust_remote_code)
    max_positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if rope is not None:
        source += f", RoPE scaling {rope.describe()}"
        log.info("memfit: RoPE scaling %s; a context-extension fine-tune: the rotary numerics differ from the"
                 " pretrained model's at every position", rope.describe())
    return LoadedModel(model, tokenizer, source, max_positions, rope, can_scale(model.config))


def _pretrained_config(name: str, config: TrainConfig):
    """The config of a local directory or Hugging Face id, to scale before the weights are loaded."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else "not found"
        raise UsageError(
            f"cannot load model {name!r} ({text[:160]}); check the id or path, or use --model tiny"
        ) from None


def _hub_id(name: str) -> str:
    """A preset's short name ('llama-3.1-8b', as `memfit plan` prints it) means its Hugging Face id."""
    if Path(name).exists():
        return name
    from memfit.models.presets import find_preset

    preset = find_preset(name)
    return preset.hf_id if preset is not None else name


def _quantized_copy(model, name: str, config: TrainConfig, dtype, attention: AttentionChoice, quantization_config,
                    rope: RopeScaling | None = None, auto_class=None, on_host: bool = False):
    """bitsandbytes quantizes while loading: write a model built from a config once into the
    run's cache, then load it back quantized (QLoRA on the built-in or a preset model).

    The saved config holds the RoPE scaling already (it is not applied twice); the directory
    name holds it too, so a copy saved without it is not read back for a scaled run."""
    rope_tag = f"-rope-{rope.rope_type}{rope.scale:g}" if rope is not None else ""
    directory = Path(config.output.output_dir) / "cache" / f"base-{name.replace('/', '-')}-seed{config.training.seed}{rope_tag}"
    if not (directory / "config.json").is_file():
        save_pretrained(model, directory, safe_serialization=True)
    return _from_pretrained(str(directory), config, dtype, attention, quantization_config, auto_class=auto_class,
                            on_host=on_host)


def _family_kernel(hf_config, attention: AttentionChoice, device: torch.device, fallback: str | None = None) -> str:
    """The attn_implementation to ask for: the chosen kernel, or what the family runs instead (said once in the log).

    `fallback`: the kernel to use when the family is one transformers does not map (the asked one raised)."""
    from memfit.models.attention_support import kernel_for_family

    runs, why = kernel_for_family(hf_config, attention.hf_name, torch.device(device).type)
    if runs == attention.hf_name and fallback is not None:
        runs, why = fallback, f"the model does not support {attention.implementation} attention; {fallback} runs"
    if why:
        log.warning("memfit: %s", why)
    return runs


def _from_pretrained(name, config: TrainConfig, dtype, attention: AttentionChoice, quantization_config, hf_config=None,
                     auto_class=None, on_host: bool = False):
    """`hf_config`: the model's config changed before loading (--rope-scale); None reads the saved one.
    `auto_class`: the task's head class (a _HeadClass), AutoModelForCausalLM when None.
    `on_host`: a quantized model is loaded (and its linears quantized) in host memory, not on the GPU."""
    from transformers import AutoModelForCausalLM

    model_class = auto_class or AutoModelForCausalLM

    kwargs = dict(
        dtype=dtype,
        trust_remote_code=config.model.trust_remote_code,
        attn_implementation=attention.hf_name,
    )
    if hf_config is not None:
        kwargs["config"] = hf_config
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": 0} if torch.cuda.is_available() and not on_host else {"": "cpu"}

    def load():
        with _load_report_held():
            return model_class.from_pretrained(name, output_loading_info=True, **kwargs)

    try:
        model, loading_info = load()
    except ValueError as error:
        if "attn_implementation" in str(error) or "does not support" in str(error):
            kwargs["attn_implementation"] = _family_kernel(hf_config or _pretrained_config(name, config), attention,
                                                           training_device(), fallback="eager")
            model, loading_info = load()
        else:
            raise UsageError(f"cannot load model {name!r}: {str(error).splitlines()[0][:200]}") from None
    except OSError as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else "not found"
        raise UsageError(
            f"cannot load model {name!r} ({text[:160]}); check the id or path, or use --model tiny"
        ) from None
    expected_new = getattr(getattr(model_class, "auto_class", model_class), "__name__", "") != "AutoModelForCausalLM"
    _say_new_weights(name, loading_info, config.training.seed, expected_new)
    return model


@contextlib.contextmanager
def _load_report_held():
    """Hold back transformers' LOAD REPORT (a table of the keys the checkpoint and the model do not share,
    17 lines for a new classification head) while from_pretrained runs: `_say_new_weights` says it in one
    line. A load that fails shows the table after all: transformers' error then points to it."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            held.append(record)
            return False
        return True

    logger = logging.getLogger("transformers.modeling_utils")  # the logger transformers reports the load on
    logger.addFilter(hold)
    try:
        yield
    except BaseException:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(hold)


def _say_new_weights(name: str, loading_info: dict, seed: int, expected: bool) -> None:
    """One line for transformers' LOAD REPORT: the weights the checkpoint lacks (initialised from --seed) and
    the checkpoint's weights the model does not use. `expected`: a task's head class, whose head is new by
    design (said at INFO); a causal LM missing weights is not the pretrained model (a warning)."""
    missing = sorted(loading_info.get("missing_keys") or ())
    unused = sorted(loading_info.get("unexpected_keys") or ())
    if not missing and not unused:
        return
    parts = []
    if missing:
        parts.append(f"newly initialised (not in {name}; --seed {seed}): {_grouped(missing, depth=None)}")
    if unused:
        parts.append(f"left unused from {'it' if missing else name}: {_grouped(unused, depth=2)}")
    level = logging.DEBUG if not missing else logging.INFO if expected else logging.WARNING
    log.log(level, "memfit: weights %s", "; ".join(parts))


def _grouped(keys: list[str], depth: int | None, shown: int = 4) -> str:
    """Parameter names as their modules ('classifier, bert.pooler.dense'), or their first `depth` name parts
    with a count ('cls.predictions (5 tensors)'); past `shown` modules, how many more."""
    groups: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        group = ".".join(parts[:-1] if depth is None else parts[:depth]) or key
        groups[group] = groups.get(group, 0) + 1
    names = [g if depth is None else f"{g} ({n} tensor{'s' if n > 1 else ''})" for g, n in groups.items()]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class _HeadClass:
    """A transformers auto class with the task head's settings (num_labels, id2label, problem_type) applied,
    called as the auto class is: `from_config(config, **kw)` and `from_pretrained(name, **kw)`."""

    def __init__(self, auto_class, head_config: dict):
        self.auto_class = auto_class
        self.head_config = head_config

    def from_config(self, hf_config, **kwargs):
        for key, value in self.head_config.items():
            setattr(hf_config, key, value)
        return self.auto_class.from_config(hf_config, **kwargs)

    def from_pretrained(self, name, **kwargs):
        if "config" in kwargs:
            for key, value in self.head_config.items():
                setattr(kwargs["config"], key, value)
            return self.auto_class.from_pretrained(name, **kwargs)
        return self.auto_class.from_pretrained(name, **kwargs, **self.head_config)

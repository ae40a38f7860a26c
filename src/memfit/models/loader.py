"""Load the model and tokenizer a run trains: `tiny`, a local directory, a Hugging Face id or a preset.

Weights are read with safetensors (transformers' default); `trust_remote_code` stays off
unless the user asks. LoRA/QLoRA wrapping happens after loading (techniques.lora); a
quantized base is loaded here because bitsandbytes quantizes at load time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from memfit.config import TrainConfig
from memfit.errors import UsageError

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
PRESET_PREFIX = "preset:"
"""`--model preset:llama-3.2-1b` trains a randomly initialised model of a preset's shape."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str
    """Where the model came from, for the log ('built-in tiny', 'directory ./m', ...)."""
    max_positions: int | None
    """Longest sequence the model handles, if it says."""


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1


def load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if name == "tiny":
        from memfit.models.tiny import byte_tokenizer

        return byte_tokenizer()
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
    config: TrainConfig, device: torch.device, attention: AttentionChoice, quantization_config=None
) -> LoadedModel:
    """Build or load the model on `device` in the configured weight dtype.

    Raises UsageError for a missing path, an unreachable id, or a model without a tokenizer.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # memfit shows its own progress
    name = config.model.model
    dtype = DTYPES[config.model.dtype]
    torch.manual_seed(config.training.seed)  # the same initial weights for a from-scratch model
    if name == "tiny":
        from memfit.models.tiny import tiny_config

        model = AutoModelForCausalLM.from_config(
            tiny_config(), dtype=dtype, attn_implementation=attention.hf_name
        )
        source = "built-in tiny (Llama architecture, random init)"
    elif name.startswith(PRESET_PREFIX):
        # Only on request: 'gpt2' alone means the pretrained weights, not a random model of that shape.
        from memfit.models.presets import is_preset, preset_config

        preset = name.removeprefix(PRESET_PREFIX)
        if not is_preset(preset):
            raise UsageError(f"unknown preset {preset!r}; memfit presets models lists them")
        model = AutoModelForCausalLM.from_config(preset_config(preset), dtype=dtype, attn_implementation=attention.hf_name)
        source = f"preset {preset} (random init)"
    else:
        if _looks_like_path(name) and not Path(name).expanduser().exists():
            raise UsageError(f"model path {name} does not exist; give a directory saved with save_pretrained, a Hugging Face id, or 'tiny'")
        name = _hub_id(name)
        model = _from_pretrained(name, config, dtype, attention, quantization_config)
        source = f"directory {name}" if Path(name).exists() else f"Hugging Face {name}"
        quantization_config = None  # from_pretrained quantized it while loading
    if quantization_config is not None:
        model = _quantized_copy(model, name, config, dtype, attention, quantization_config)
    else:
        model.to(device)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    tokenizer_name = config.model.tokenizer or name
    if tokenizer_name == name and source.startswith("preset"):
        tokenizer_name = "tiny"  # a preset has no tokenizer files: byte tokens fit any vocabulary of 257+
        source += ", byte tokenizer (pass --tokenizer for the real one)"
    tokenizer = load_tokenizer(tokenizer_name, config.model.trust_remote_code)
    max_positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    return LoadedModel(model, tokenizer, source, max_positions)


def _hub_id(name: str) -> str:
    """A preset's short name ('llama-3.1-8b', as `memfit plan` prints it) means its Hugging Face id."""
    if Path(name).exists():
        return name
    from memfit.models.presets import find_preset

    preset = find_preset(name)
    return preset.hf_id if preset is not None else name


def _quantized_copy(model, name: str, config: TrainConfig, dtype, attention: AttentionChoice, quantization_config):
    """bitsandbytes quantizes while loading: write a model built from a config once into the
    run's cache, then load it back quantized (QLoRA on the built-in or a preset model)."""
    directory = Path(config.output.output_dir) / "cache" / f"base-{name.replace('/', '-')}-seed{config.training.seed}"
    if not (directory / "config.json").is_file():
        model.save_pretrained(directory, safe_serialization=True)
    return _from_pretrained(str(directory), config, dtype, attention, quantization_config)


def _from_pretrained(name, config: TrainConfig, dtype, attention: AttentionChoice, quantization_config):
    from transformers import AutoModelForCausalLM

    kwargs = dict(
        dtype=dtype,
        trust_remote_code=config.model.trust_remote_code,
        attn_implementation=attention.hf_name,
    )
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": 0} if torch.cuda.is_available() else {"": "cpu"}
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except ValueError as error:
        if "attn_implementation" in str(error) or "does not support" in str(error):
            log.warning("memfit: %s does not support %s attention; using eager", name, attention.implementation)
            kwargs["attn_implementation"] = "eager"
            return AutoModelForCausalLM.from_pretrained(name, **kwargs)
        raise UsageError(f"cannot load model {name!r}: {str(error).splitlines()[0][:200]}") from None
    except OSError as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else "not found"
        raise UsageError(
            f"cannot load model {name!r} ({text[:160]}); check the id or path, or use --model tiny"
        ) from None

"""Model architectures without weights: offline presets and meta-device builds.

`resolve_model_config("llama-3.1-8b")` returns a transformers config built from the
numbers of the published config, with no network; a local directory or config.json is
read from disk; any other Hugging Face id is fetched with `AutoConfig.from_pretrained`
(the config only, never weights). `build_meta_model(config)` makes the model on the
meta device: every shape, no memory, a 70B model in well under a second.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.config_loading import suggest
from memfit.errors import UsageError
from memfit.models.presets_encoders import ENCODER_PRESETS
from memfit.models.presets_moe import MOE_AND_RECENT_PRESETS


@dataclass(frozen=True)
class ModelPreset:
    """The architecture numbers of a published model config."""

    name: str
    hf_id: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tie_embeddings: bool
    extra: dict[str, Any] = field(default_factory=dict)
    """Further config fields (head_dim, rope_theta, attention bias, ...)."""

    def to_hf_config(self) -> Any:
        """The transformers config of this architecture."""
        from transformers import AutoConfig

        if self.model_type == "gpt2":
            fields = dict(
                n_embd=self.hidden_size, n_layer=self.num_layers, n_head=self.num_heads,
                n_positions=self.max_positions, n_inner=None,
            )
        else:
            fields = dict(
                hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                intermediate_size=self.intermediate_size, max_position_embeddings=self.max_positions,
            )
        # a copy: transformers keeps (and fills in) the rope_scaling dict it is given
        fields.update(vocab_size=self.vocab_size, tie_word_embeddings=self.tie_embeddings, **copy.deepcopy(self.extra))
        config = AutoConfig.for_model(self.model_type, **fields)
        config.name_or_path = self.hf_id
        return config


_LLAMA3_ROPE = {"rope_theta": 500000.0}
# Llama 3.1 and 3.2 stretch Llama 3's 8192 pretraining positions with their own RoPE scaling (as published).
_LLAMA31_ROPE = _LLAMA3_ROPE | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
_LLAMA32_ROPE = _LLAMA3_ROPE | {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
_QWEN = {"rope_theta": 1000000.0}

MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("gpt2", "openai-community/gpt2", "gpt2", 768, 12, 12, 12, 3072, 50257, 1024, True),
        ModelPreset("gpt2-medium", "openai-community/gpt2-medium", "gpt2", 1024, 24, 16, 16, 4096, 50257, 1024, True),
        ModelPreset("gpt2-large", "openai-community/gpt2-large", "gpt2", 1280, 36, 20, 20, 5120, 50257, 1024, True),
        ModelPreset("gpt2-xl", "openai-community/gpt2-xl", "gpt2", 1600, 48, 25, 25, 6400, 50257, 1024, True),
        ModelPreset("llama-2-7b", "meta-llama/Llama-2-7b-hf", "llama", 4096, 32, 32, 32, 11008, 32000, 4096, False),
        ModelPreset("llama-2-13b", "meta-llama/Llama-2-13b-hf", "llama", 5120, 40, 40, 40, 13824, 32000, 4096, False),
        ModelPreset("llama-2-70b", "meta-llama/Llama-2-70b-hf", "llama", 8192, 80, 64, 8, 28672, 32000, 4096, False),
        ModelPreset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", "llama", 4096, 32, 32, 8, 14336, 128256, 8192, False, _LLAMA3_ROPE),
        ModelPreset("llama-3-70b", "meta-llama/Meta-Llama-3-70B", "llama", 8192, 80, 64, 8, 28672, 128256, 8192, False, _LLAMA3_ROPE),
        ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, False, _LLAMA31_ROPE),
        ModelPreset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", "llama", 8192, 80, 64, 8, 28672, 128256, 131072, False, _LLAMA31_ROPE),
        ModelPreset("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, 131072, True, _LLAMA32_ROPE | {"head_dim": 64}),
        ModelPreset("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128256, 131072, True, _LLAMA32_ROPE | {"head_dim": 128}),
        ModelPreset("mistral-7b", "mistralai/Mistral-7B-v0.1", "mistral", 4096, 32, 32, 8, 14336, 32000, 32768, False, {"sliding_window": 4096}),
        ModelPreset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, 32768, True, _QWEN),
        ModelPreset("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, 131072, True, _QWEN),
        ModelPreset("qwen2.5-3b", "Qwen/Qwen2.5-3B", "qwen2", 2048, 36, 16, 2, 11008, 151936, 32768, True, _QWEN),
        ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, 131072, False, _QWEN),
        ModelPreset("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", "phi3", 3072, 32, 32, 32, 8192, 32064, 4096, False),
        ModelPreset("gemma-2b", "google/gemma-2b", "gemma", 2048, 18, 8, 1, 16384, 256000, 8192, True, {"head_dim": 256}),
    )
}


MODEL_PRESETS.update(ENCODER_PRESETS)  # DNA and protein encoders: models.presets_encoders
MODEL_PRESETS.update({name: ModelPreset(*row) for name, row in MOE_AND_RECENT_PRESETS.items()})  # models.presets_moe


def _preset_key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


_BY_HF_ID = {p.hf_id.lower(): p.name for p in MODEL_PRESETS.values()}


def find_preset(name: str) -> ModelPreset | None:
    """The preset called `name` (or whose Hugging Face id is `name`), else None."""
    key = _preset_key(name)
    key = _BY_HF_ID.get(name.strip().lower(), key)
    key = {"gpt2-small": "gpt2", "gpt-2": "gpt2", "phi-3-mini-4k": "phi-3-mini"}.get(key, key)
    return MODEL_PRESETS.get(key)


def tiny_hf_config() -> Any:
    """The built-in tiny model's config (the loader's when present, else the same numbers)."""
    try:
        from memfit.models.tiny import tiny_config

        return tiny_config()
    except ImportError:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        )


def resolve_model_config(model: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of `model`, read without weights.

    `model` is 'tiny', a preset name (optionally 'preset:NAME') or the Hugging Face id of one, a local directory
    holding config.json, a path to a config.json, or another Hugging Face id (needs the
    network or a cached copy).

    Raises:
        UsageError: the model cannot be resolved; the message says what to do.
    """
    if model == "tiny":
        return tiny_hf_config()
    model = model.removeprefix("preset:")  # how `memfit train` names a randomly initialised preset
    preset = find_preset(model)
    if preset is not None:
        return preset.to_hf_config()
    path = Path(model).expanduser()
    if path.is_dir() or path.suffix == ".json":
        return _config_from_path(path, trust_remote_code)
    if "/" not in model or model.startswith((".", "/", "~")):
        known = list(MODEL_PRESETS)
        raise UsageError(
            f"unknown model {model!r}{suggest(_preset_key(model), known)}: give a preset (memfit presets models),"
            " a local directory with config.json, or a Hugging Face id"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as error:  # network, missing repo, gated repo: all the user's to fix
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"could not read the config of {model!r} from the Hugging Face Hub ({first_line[:160]}); "
            "offline, use a preset (memfit presets models) or a local directory with config.json"
        ) from None


def _config_from_path(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise UsageError(f"{config_file} does not exist: --model needs a directory holding config.json or the file itself")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{config_file} is not valid JSON: {error}") from None
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise UsageError(f"{config_file} has no model_type: it is not a transformers model config")
    if path.is_dir():
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return AutoConfig.for_model(model_type, **data)


def build_meta_model(hf_config: Any, attention: str | None = None) -> Any:
    """The causal LM of `hf_config` on the meta device: shapes only, no memory, no init cost."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attention} if attention else {}
    model_class = AutoModelForCausalLM
    if any(name.endswith("ForMaskedLM") for name in getattr(hf_config, "architectures", None) or ()) or (
            type(hf_config) not in AutoModelForCausalLM._model_mapping):  # ESM, ModernBERT: no causal-LM class
        from transformers import AutoModelForMaskedLM as model_class  # an encoder: built with its published head
    with torch.device("meta"):
        return model_class.from_config(hf_config, **kwargs)


def parameter_count(hf_config: Any) -> int:
    """Trainable parameters of the architecture, from the config numbers alone (tied weights once).

    Covers the families of the presets (GPT-2, Llama, Mistral, Qwen2, Phi-3, Gemma); other
    model types are counted on a meta-device build.
    """
    c = hf_config
    vocab = c.vocab_size
    tied = bool(getattr(c, "tie_word_embeddings", False))
    if c.model_type == "gpt2":
        h, layers, positions = c.n_embd, c.n_layer, c.n_positions
        inner = c.n_inner or 4 * h
        per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
        return vocab * h + positions * h + layers * per_layer + 2 * h + (0 if tied else vocab * h)
    if c.model_type in ("llama", "mistral", "qwen2", "phi3", "gemma"):
        h, layers = c.hidden_size, c.num_hidden_layers
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or h // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        attention = h * q + 2 * h * kv + q * h
        if c.model_type == "qwen2" or getattr(c, "attention_bias", False):
            attention += q + 2 * kv + (h if getattr(c, "attention_bias", False) else 0)
        mlp = 3 * h * c.intermediate_size + (h + 2 * c.intermediate_size if getattr(c, "mlp_bias", False) else 0)
        per_layer = attention + mlp + 2 * h
        return vocab * h + layers * per_layer + h + (0 if tied else vocab * h)
    model = build_meta_model(c)
    return sum(p.numel() for p in model.parameters())


def list_model_presets() -> list[ModelPreset]:
    """Every preset, smallest first."""
    return sorted(MODEL_PRESETS.values(), key=lambda p: parameter_count(p.to_hf_config()))


def is_preset(name: str) -> bool:
    """Whether `name` is a preset name or the Hugging Face id of one."""
    return find_preset(name) is not None


def preset_config(name: str) -> Any:
    """The transformers config of preset `name` (see is_preset)."""
    preset = find_preset(name)
    if preset is None:
        raise UsageError(f"unknown model preset {name!r}{suggest(_preset_key(name), list(MODEL_PRESETS))}")
    return preset.to_hf_config()

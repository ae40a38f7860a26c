"""Load the model and tokenizer a run trains: `tiny`, a local directory, a Hugging Face id or a preset.

Every command that takes --model asks `check_model_flags` first: a name that is neither `tiny`, a
preset, a local directory nor a model in the Hugging Face cache gets ONE Hub look-up (no retries, a
short timeout, none with HF_HUB_OFFLINE) and is refused in one line naming the closest presets and
directories, instead of transformers' minute of retries. A cached model whose Hub cannot be reached
is read from the cache alone.

Weights are read with safetensors (transformers' default); `trust_remote_code` stays off
unless the user asks. LoRA/QLoRA wrapping happens after loading (techniques.lora); a
quantized base is loaded here because bitsandbytes quantizes at load time. `--rope-scale`
changes the model config's RoPE before the model is built (models.rope).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from memfit.checkpoint_files.pretrained import save_pretrained
from memfit.config import TrainConfig
from memfit.errors import UsageError
from memfit.hardware import training_device
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
PRESET_PREFIX = "preset:"
"""`--model preset:llama-3.2-1b` trains a randomly initialised model of a preset's shape."""


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


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1


# ---------------------------------------------------------------------------
# Model names: what --model names, asked once, answered in one line
# ---------------------------------------------------------------------------

HUB_LOOKUP_TIMEOUT_S = 5.0
"""How long the one Hub look-up of a name the cache does not hold may take (it is never retried)."""

_hub_answers: dict[str, bool] = {}
"""Hub ids found loadable, asked once a process (the CLI's check, then the loader's and the tokenizer's)."""
_NOT_ON_HUB = "not found"


def check_model_flags(config: TrainConfig, weights: bool = True) -> None:
    """Refuse, before anything is read or written, a --model (or --tokenizer) that names no model.

    `weights`: the command loads the model's files (train, profile, find-batch-size, data); without them
    (estimate, plan) a preset or a config.json is all it reads, and a bare name must be a preset.
    Raises UsageError in one line with the closest presets, local directories and cached ids.
    """
    check_model_name(config.model.model, weights=weights)
    if weights and config.model.tokenizer:
        check_model_name(config.model.tokenizer, flag="--tokenizer")


def check_model_name(name: str, weights: bool = True, flag: str = "--model") -> None:
    """Whether `name` is `tiny`, `preset:NAME`, a preset, an existing path or a Hugging Face id that can be had.

    A Hugging Face id is looked for in the Hugging Face cache first; then, unless HF_HUB_OFFLINE is set, the
    Hub is asked once (a HEAD of its config.json, HUB_LOOKUP_TIMEOUT_S, no retries). An id the cache holds
    is loaded from the cache alone when the Hub cannot be reached (`_read_cache_only`). A preset's short
    name loads its Hugging Face weights, so with `weights` its id is checked the same way.
    """
    if name == "tiny":
        return
    from memfit.models.presets import find_preset, is_preset

    what = "tokenizer" if flag == "--tokenizer" else "model"
    if name.startswith(PRESET_PREFIX):
        preset = name.removeprefix(PRESET_PREFIX)
        if not is_preset(preset):
            raise UsageError(f"unknown preset {preset!r}{_did_you_mean(preset, presets_only=True)}:"
                             " memfit presets models lists them")
    elif Path(name).expanduser().exists():
        pass  # a directory (or estimate's config.json): its reader says what it lacks
    elif _looks_like_path(name):
        raise UsageError(f"{what} path {name} does not exist{_did_you_mean(name)}: give a directory saved with"
                         " save_pretrained, a Hugging Face id, a preset (memfit presets models) or 'tiny'")
    elif (preset := find_preset(name)) is not None:
        if weights and (why := _hub_problem(preset.hf_id)):
            raise UsageError(f"{flag} {name} loads the weights of {preset.hf_id}: not in the Hugging Face cache, and"
                             f" {why}; {flag} preset:{preset.name} trains one of its shape from random weights")
    elif not weights and "/" not in name:  # what estimate and plan read: presets, config files and namespaced ids
        raise UsageError(f"unknown {what} {name!r}{_did_you_mean(name)}: give a preset (memfit presets models),"
                         " a local directory with config.json, or a Hugging Face id (namespace/name)")
    elif not _valid_hub_id(name):
        raise UsageError(f"unknown {what} {name!r}{_did_you_mean(name)}: not a preset (memfit presets models),"
                         " a local directory or a valid Hugging Face id (namespace/name)")
    elif why := _hub_problem(name):
        raise UsageError(f"unknown {what} {name!r}{_did_you_mean(name)}: not a preset (memfit presets models),"
                         f" a local directory or a model in the Hugging Face cache, and {why}")


def _valid_hub_id(name: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def _hub_problem(hub_id: str) -> str | None:
    """None when `hub_id` can be loaded (the cache holds it, or the Hub has it); else why not, in words."""
    if _hub_answers.get(hub_id):
        return None
    from huggingface_hub import constants

    cached = _in_hub_cache(hub_id)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            return "HF_HUB_OFFLINE is set (the Hub was not asked)"
    else:
        problem = _ask_hub(hub_id)
        if problem == _NOT_ON_HUB and not cached:
            return "the Hub has no such model (a private or gated one needs `hf auth login`)"
        if problem is not None and not cached:
            return f"the Hub could not be reached ({problem})"
        if problem is not None:
            _read_cache_only(hub_id, "the Hub has no such model" if problem == _NOT_ON_HUB
                             else f"the Hub could not be reached: {problem}")
    _hub_answers[hub_id] = True
    return None


def _in_hub_cache(hub_id: str) -> bool:
    """Whether the Hugging Face cache holds this id's config.json (a model), tokenizer_config.json (a tokenizer)
    or adapter_config.json (a PEFT adapter, which transformers loads over its base)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json", "adapter_config.json"):
        try:
            if isinstance(try_to_load_from_cache(hub_id, filename), str):
                return True
        except (OSError, ValueError):  # an unreadable cache is an empty one
            return False
    return False


def _ask_hub(hub_id: str) -> str | None:
    """One HEAD of the id's config.json, not retried: None when the id exists, _NOT_ON_HUB, or why it failed."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    kwargs = {"timeout": HUB_LOOKUP_TIMEOUT_S}
    if "retry_on_errors" in inspect.signature(get_hf_file_metadata).parameters:  # huggingface_hub >= 1.0
        kwargs["retry_on_errors"] = False
    try:
        get_hf_file_metadata(hf_hub_url(hub_id, "config.json"), **kwargs)
    except GatedRepoError:
        return None  # it exists; access is from_pretrained's to report
    except RepositoryNotFoundError:
        return _NOT_ON_HUB
    except HfHubHTTPError:
        return None  # the repository answered (no config.json: an adapter or a tokenizer; a server error)
    except Exception as error:  # no network, no DNS, a timeout: nothing the Hub said
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return text[:120]
    return None


def _read_cache_only(hub_id: str, why: str) -> None:
    """The rest of this process reads the Hugging Face cache only, as HF_HUB_OFFLINE=1 would make it.

    Else transformers asks the unreachable Hub for every optional file of the model (adapter, chat
    template, processor configs), retrying each for half a minute: minutes for a model it has already.
    huggingface_hub reads its offline flag on each request (`constants.HF_HUB_OFFLINE`, what
    `is_offline_mode()` returns); the environment variable carries it to the processes this one starts.
    """
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    log.info("memfit: %s is read from the Hugging Face cache (%s)", hub_id, why)


def _did_you_mean(name: str, presets_only: bool = False) -> str:
    """' (did you mean A, B or C?)': the presets, local model directories and cached Hub ids closest to `name`."""
    from memfit.models.presets import MODEL_PRESETS

    candidates = ["tiny", *MODEL_PRESETS]
    if not presets_only:
        candidates += _local_model_dirs(name) + _cached_hub_ids()
    key = name.strip().lower()
    words = set(re.split(r"[-_/.\s]+", key))

    def score(candidate: str) -> float:
        """Likeness of the whole name or of the part after the namespace; a name one of whose words is a
        candidate ('llama-9000-tiny' holds 'tiny') is as close as a typo."""
        lowered = candidate.lower()
        whole = difflib.SequenceMatcher(None, key, lowered).ratio()
        tail = difflib.SequenceMatcher(None, key.rstrip("/").rsplit("/", 1)[-1],
                                       lowered.rstrip("/").rsplit("/", 1)[-1]).ratio()
        return max(whole, tail, 0.8 if lowered in words else 0.0)

    ranked = sorted(((score(c), c) for c in dict.fromkeys(candidates)), key=lambda pair: -pair[0])
    close = [candidate for value, candidate in ranked[:3] if value >= 0.5]
    if not close:
        return ""
    return f" (did you mean {', '.join(close[:-1]) + ' or ' + close[-1] if len(close) > 1 else close[0]}?)"


def _local_model_dirs(name: str, limit: int = 500) -> list[str]:
    """Directories holding a config.json in the working directory and in the nearest existing parent of `name`."""
    roots = [Path(".")]
    parent = Path(name).expanduser().parent
    while parent != parent.parent and not parent.is_dir():
        parent = parent.parent
    if parent.is_dir() and parent.resolve() != Path(".").resolve():
        roots.append(parent)
    found: list[str] = []
    for root in roots:
        try:
            children = sorted(root.iterdir())[:limit]
        except OSError:
            continue
        for child in children:
            with contextlib.suppress(OSError):
                if (child / "config.json").is_file():
                    found.append(f"./{child.name}" if root == Path(".") else str(child))
    return found


def _cached_hub_ids(limit: int = 500) -> list[str]:
    """The model ids the Hugging Face cache holds (its `models--NAMESPACE--NAME` folders)."""
    from huggingface_hub import constants

    try:
        names = sorted(os.listdir(constants.HF_HUB_CACHE))[:limit]
    except OSError:
        return []
    return [n.removeprefix("models--").replace("--", "/") for n in names if n.startswith("models--")]


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

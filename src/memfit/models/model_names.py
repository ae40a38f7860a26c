"""What --model names, checked before anything loads: asked once, answered in one line.

Every command that takes --model asks `check_model_flags` first: a name that is neither `tiny`, a preset, a local
directory nor a model in the Hugging Face cache gets ONE Hub look-up (no retries, a short timeout, none with
HF_HUB_OFFLINE) and is refused in one line naming the closest presets and directories, instead of transformers'
minute of retries. A cached model whose Hub cannot be reached is read from the cache alone. Nothing here imports
torch, so the check costs the command line nothing before it refuses.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import re
from pathlib import Path

from memfit.config import TrainConfig
from memfit.errors import UsageError

log = logging.getLogger("memfit")

PRESET_PREFIX = "preset:"
"""`--model preset:llama-3.2-1b` trains a randomly initialised model of a preset's shape."""


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1


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
        if preset == "tiny":
            raise UsageError("'tiny' is memfit's built-in model, not a preset: give --model tiny")
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

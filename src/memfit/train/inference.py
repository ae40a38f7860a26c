"""Use what a run trained: the merged model (`memfit merge`) and samples from it (`memfit generate`).

    run = open_run("runs/memfit")                  # final/ (or best/) and the run's config; UsageError if incomplete
    merge_run(run, "runs/memfit/merged")           # base + LoRA adapters folded in, safetensors, from_pretrained-ready
    model, tokenizer = load_for_inference(run, device)
    text = generate(model, tokenizer, messages=[{"role": "user", "content": "Hi"}], seed=0)

A run directory is complete when its model directory (final/, or best/ of --save-best) holds a
model or an adapter, and a checkpoint keeps the run's configuration (the base model of a LoRA
run is rebuilt from it, exactly as training loaded it: the same path or id, weight dtype, seed
for a built-in or preset model, RoPE scaling). A resumed run is no different: its final model
and last checkpoint are those of the resumed launch.

A QLoRA run's adapters are merged into the unquantized base: the base is loaded again without
quantization (the weights before they were quantized), never dequantized from 4-bit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoint_files import list_checkpoints
from memfit.checkpoint_files.pretrained import save_pretrained
from memfit.config import SECTIONS, TrainConfig, field_index
from memfit.errors import DoesNotFitError, UsageError
from memfit.memory.cap import is_out_of_memory

log = logging.getLogger("memfit")

FINAL_DIR = "final"
BEST_DIR = "best"
MERGED_DIR = "merged"


@dataclass
class TrainedRun:
    """A complete run directory: where its model is and how it was trained."""

    run_dir: Path
    model_dir: Path
    """final/ or best/: a full model (config.json) or a LoRA adapter (adapter_config.json), with the tokenizer."""
    config: TrainConfig
    """The run's configuration, as its newest checkpoint kept it."""

    @property
    def is_adapter(self) -> bool:
        return (self.model_dir / "adapter_config.json").is_file()

    @property
    def quantized(self) -> str:
        """The base's quantization during training ('4bit', '8bit') or 'none'."""
        return self.config.lora.quantize if self.is_adapter else "none"


def open_run(run_dir: str | Path, which: str = FINAL_DIR) -> TrainedRun:
    """The trained model of `run_dir` (`which`: final or best). Raises UsageError, in one line, when incomplete."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} does not exist: give the --output-dir of a finished memfit train run")
    model_dir = run_dir / which
    has_model = (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))
    has_adapter = (model_dir / "adapter_config.json").is_file() and (model_dir / "adapter_model.safetensors").is_file()
    if not (has_model or has_adapter):
        hint = ("the run kept no best model: train with --save-best and an eval set" if which == BEST_DIR else
                "the run did not finish; complete it with memfit train --resume auto (same flags)")
        raise UsageError(f"{run_dir} is not a complete run: no {which} model in {model_dir}; {hint}")
    config = saved_config(run_dir)
    if config is None:
        raise UsageError(
            f"{run_dir} is not a complete run: no checkpoint keeps its configuration ({run_dir}/checkpoints/step-N/"
            "trainer_state.json); give the whole run directory"
        )
    return TrainedRun(run_dir, model_dir, config)


def saved_config(run_dir: Path) -> TrainConfig | None:
    """The run's TrainConfig from its newest checkpoint (settings this version does not know are left out)."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        try:
            nested = json.loads((checkpoint / "trainer_state.json").read_text()).get("config")
        except (OSError, ValueError):
            continue
        if not isinstance(nested, dict):
            continue
        known = field_index()
        values = {name: value for section in nested.values() if isinstance(section, dict)
                  for name, value in section.items() if name in known and known[name][0] in SECTIONS}
        try:
            return TrainConfig.from_flat(values)
        except UsageError:
            continue
    return None


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _attention(config: TrainConfig, device: torch.device):
    from memfit.techniques.attention import run_attention

    return run_attention(config, device, None)


def load_base(run: TrainedRun, device: torch.device, quantization=None) -> torch.nn.Module:
    """The base model of a LoRA run, loaded as training loaded it (unquantized unless `quantization` is given)."""
    from memfit.models.loader import load_model_and_tokenizer

    config = run.config.replace(output_dir=str(run.run_dir))  # a quantized copy of a built-in base lives in its cache
    return load_model_and_tokenizer(config, device, _attention(config, device), quantization).model


def load_for_inference(run: TrainedRun, device: torch.device, merge: bool = True,
                       keep_quantized: bool = True) -> tuple[torch.nn.Module, Any]:
    """The trained model on `device`, in eval mode, with the tokenizer saved beside it.

    A LoRA run: the base plus the adapters, merged in memory (`merge`) when the base is not
    quantized; a QLoRA run on a CUDA device with bitsandbytes keeps its 4/8-bit base and the
    adapters unmerged, as in training, elsewhere it runs on the unquantized base (said in the log).
    `keep_quantized=False` always loads the base unquantized (what merging needs).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    if not run.is_adapter:
        model = AutoModelForCausalLM.from_pretrained(run.model_dir, dtype=_weight_dtype(run.config)).to(device)
    else:
        from peft import PeftModel

        quantization = None
        if run.quantized != "none" and keep_quantized and device.type == "cuda":
            from memfit.techniques.lora import quantization_config

            quantization = quantization_config(run.config.lora, torch.bfloat16)
        elif run.quantized != "none" and keep_quantized:
            log.info("memfit: the run trained over a %s base; on %s it runs over the unquantized base", run.quantized,
                     device.type)
        base = load_base(run, device, quantization)
        with warnings.catch_warnings():  # PEFT asks transformers a deprecated question while merging
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(base, run.model_dir)
            if merge and quantization is None:
                model = model.merge_and_unload()
    model.config.use_cache = True  # training turned the KV cache off; generation wants it
    return model.eval(), tokenizer


def _weight_dtype(config: TrainConfig) -> torch.dtype:
    from memfit.models.loader import DTYPES

    return DTYPES[config.model.dtype]


# ---------------------------------------------------------------------------
# memfit merge
# ---------------------------------------------------------------------------


@dataclass
class MergeResult:
    directory: Path
    note: str
    """One line for the user: what was merged into what."""


def merge_run(run: TrainedRun, output_dir: str | Path | None = None, memory_cap: int | None = None) -> MergeResult:
    """Write the base with the run's LoRA adapters merged: safetensors and the tokenizer, loadable with
    `AutoModelForCausalLM.from_pretrained`. The merge runs on the CPU (one copy of the base and the adapters).

    `memory_cap`: the bytes the merge may hold; more raises DoesNotFitError. Raises UsageError for a run
    that trained every weight (its final/ is already a full model) and for an output directory that holds
    something else than a model.
    """
    if not run.is_adapter:
        raise UsageError(
            f"nothing to merge: the run trained every weight; {run.model_dir} loads with"
            " AutoModelForCausalLM.from_pretrained as it is"
        )
    directory = Path(output_dir) if output_dir is not None else run.run_dir / MERGED_DIR
    if directory.exists() and any(directory.iterdir()) and not (directory / "config.json").is_file():
        raise UsageError(f"--output {directory} holds files that are not a model; give an empty or new directory")
    device = torch.device("cpu")
    with _memory_capped(device, memory_cap, "merging"):
        model, tokenizer = load_for_inference(run, device, merge=True, keep_quantized=False)
        temporary = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
        shutil.rmtree(temporary, ignore_errors=True)
        model.config.use_cache = True
        save_pretrained(model, temporary, safe_serialization=True)
        tokenizer.save_pretrained(temporary)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(temporary, directory)
    base = run.config.model.model
    if run.quantized != "none":
        note = (f"the run trained over a {run.quantized} base: its adapters are merged into the unquantized base"
                f" ({base}, {run.config.model.dtype}), loaded again without quantization")
    else:
        note = f"adapters of {run.model_dir.name}/ merged into {base} ({run.config.model.dtype})"
    return MergeResult(directory, note)


# ---------------------------------------------------------------------------
# memfit generate
# ---------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, prompt: str | None = None, messages: list[dict] | None = None) -> tuple[torch.Tensor, bool]:
    """Token ids to continue, and whether the chat template rendered them.

    A tokenizer with a chat template renders `messages` (or `prompt` as one user turn) with the
    assistant's turn opened, tokenized as training tokenized conversations (no special tokens
    added again); without one, the plain prompt text is continued.
    """
    template = getattr(tokenizer, "chat_template", None)
    if template:
        turns = messages if messages is not None else [{"role": "user", "content": prompt or ""}]
        continuing = turns[-1].get("role") == "assistant"
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=not continuing,
                                             continue_final_message=continuing)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor([ids], dtype=torch.long), True
    if messages is not None:
        raise UsageError("the run's tokenizer has no chat template to render --messages with; give --prompt TEXT")
    ids = tokenizer(prompt or "", add_special_tokens=True)["input_ids"]
    if not ids:
        raise UsageError("--prompt is empty and the tokenizer adds no start token: give some text to continue")
    return torch.tensor([ids], dtype=torch.long), False


def generate(model: torch.nn.Module, tokenizer: Any, prompt: str | None = None, messages: list[dict] | None = None,
             max_new_tokens: int = 128, seed: int = 0, temperature: float = 0.7, top_p: float = 1.0,
             memory_cap: int | None = None) -> str:
    """Sample a continuation (the new text only). The same seed gives the same text on the same device.

    temperature 0 decodes greedily. `memory_cap`: the device bytes generation may hold (emulated on a
    CPU, the allocator's limit on CUDA); more raises DoesNotFitError.
    """
    device = next(model.parameters()).device
    input_ids, _ = prompt_ids(tokenizer, prompt, messages)
    input_ids = input_ids.to(device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with _memory_capped(device, memory_cap, "generation", model), torch.no_grad():
        output = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, top_k=None, **sampling,
        )
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


@contextlib.contextmanager
def _memory_capped(device: torch.device, cap: int | None, what: str, model: torch.nn.Module | None = None):
    """Run under --memory-cap: the CUDA allocator's limit, or on a CPU the tracker's emulated cap."""
    if cap is None:
        yield
        return
    from memfit.units import format_bytes

    try:
        if device.type == "cuda":
            from memfit.memory.cap import apply_memory_cap

            apply_memory_cap(device, cap)
            yield
        else:
            from memfit.memory.tracker import MemoryTracker

            tracker = MemoryTracker(device, cap_bytes=cap)
            if model is not None:
                tracker.attach(model)
                if tracker.current_bytes > cap:
                    raise torch.OutOfMemoryError(f"the weights alone take {format_bytes(tracker.current_bytes)}")
            with tracker:
                yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise DoesNotFitError(
            f"{what} does not fit in --memory-cap {format_bytes(cap)} ({first}); raise the cap"
            + (", or lower --max-new-tokens" if what == "generation" else "")
        ) from None

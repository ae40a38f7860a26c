"""The frozen reference that DPO and KTO compare the trained policy with, at the least memory that gives its numbers.

A reference log-probability is the summed log-probability of a completion under the model as it was before
training. Three ways to have it, chosen by --reference (`choose_reference`):

- adapters-off (the default under --lora-r): the trained model itself with its LoRA adapters disabled (PEFT's
  `disable_adapter()`), under `torch.no_grad`. The base weights never train, so this is the model before training,
  exactly; no second copy of anything. Costs one extra no-grad forward per micro-batch.
- copy (the default without LoRA): a frozen copy of the loaded model on the device, in eval mode (`frozen_copy`).
  Costs the model's bytes once more, and one extra no-grad forward per micro-batch. Under FSDP2 and ZeRO-3 the
  task shards it like the policy (distributed/reference_shards.py): 1/N of those bytes a rank.
- host-copy (asked for, never chosen by auto): the same frozen copy kept in host memory and brought to the device one
  block at a time while it runs (techniques/streamed_reference.py). Costs the model's bytes in host memory, about one
  block's on the device, and the copy's bytes over the host link every micro-batch.
- cached (--reference cached, TRL's --precompute-ref-log-probs): every item's reference log-probabilities computed
  once, before training, in one streamed no-grad pass (`precompute_logprobs`), and kept in a safetensors file beside
  the token cache. Costs that pass (or reading the file) once; nothing per step, and no copy. The file is keyed
  (`cache_key`) by the model (its name, config and a checksum of its weights: `model_fingerprint`), the data (every
  token of every item), the template and the settings that change the numbers; a file whose key does not match is
  recomputed and overwritten, never reused.

SimPO and ORPO use no reference ("none").

Numerics: every mode runs the same chunked log-probabilities (techniques/sequence_logprobs.py) under the step's
autocast, so copy, adapters-off and cached agree up to float summation order.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.techniques.sequence_logprobs import sequence_logprobs
from memfit.techniques.streamed_reference import HOST_COPY, StreamedReference, reference_pass, streamed_copy

log = logging.getLogger("memfit")

NO_REFERENCE = "none"
COPY_MODES = ("copy", HOST_COPY)
"""References that run a frozen copy of the loaded model each step: whole on the device, or streamed from the host."""
CACHE_FORMAT = 1
"""Bumped when what the cache file holds changes: an older file's key then never matches."""
_CHECKSUM_CHUNK = 1 << 24
"""Elements per step of the weights' checksum: a float64 temporary of 128 MiB at most, whatever the tensor."""

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(input_ids, labels, attention_mask) of a slice of items, on the host: the rows whose log-probabilities are summed."""


# -- which reference ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceChoice:
    """The reference a run uses, and why."""

    mode: str
    """none, adapters-off, copy, host-copy or cached."""
    reason: str
    """Why this one, in words (the log and the metrics' start line)."""


def choose_reference(requested: str, precompute: bool, lora: bool, needs_reference: bool) -> ReferenceChoice:
    """The reference of --reference `requested` (auto, adapters-off, copy, host-copy, cached) and --precompute-ref-log-probs
    `precompute`, for a run with LoRA adapters or without (`lora`); `needs_reference`: the objective reads one.

    Raises ValueError for a reference that cannot run (adapters-off without adapters) or a contradiction; the task
    words it as a refusal.
    """
    if not needs_reference:
        return ReferenceChoice(NO_REFERENCE, "the objective compares the policy's own completions")
    if precompute and requested not in ("auto", "cached"):
        raise ValueError(f"--precompute-ref-log-probs is --reference cached, not {requested}")
    if precompute or requested == "cached":
        return ReferenceChoice("cached", "asked: computed once before training, no copy and no forward per step")
    if requested == "adapters-off":
        if not lora:
            raise ValueError("--reference adapters-off needs LoRA adapters to disable: add --lora-r, or use --reference"
                             " copy or cached")
        return ReferenceChoice("adapters-off", "asked: the trained model with its adapters disabled")
    if requested == "copy":
        return ReferenceChoice("copy", "asked: a frozen copy of the model")
    if requested == HOST_COPY:
        return ReferenceChoice(HOST_COPY, "asked: a frozen copy in host memory, streamed to the device a block at a"
                                          " time")
    if lora:
        return ReferenceChoice("adapters-off", "LoRA keeps the base weights frozen: the model with its adapters off is"
                                               " the reference, no copy")
    return ReferenceChoice("copy", "full training moves every weight: a frozen copy keeps the starting ones;"
                                   " --reference cached saves its memory")


@dataclass
class ReferenceCost:
    """What the reference cost this run, for the log and the metrics' start line."""

    mode: str
    """none, adapters-off, copy, host-copy or cached."""
    reason: str
    """Why this mode (ReferenceChoice.reason)."""
    copy_bytes: int = 0
    """copy: bytes of the frozen copy's weights and buffers on the device (the whole copy's, sharded or not)."""
    copy_sharding: str = ""
    """copy: fsdp or zero-3 when the copy is sharded over the ranks like the policy (distributed/reference_shards.py),
    '' when every rank holds it whole."""
    copy_ranks: int = 1
    """copy: ranks the copy is sharded over (1: whole)."""
    copy_rank_bytes: int = 0
    """copy: bytes of the copy one rank holds between passes (its shards and buffers); copy_bytes when whole."""
    stream: StreamedReference | None = None
    """host-copy: the streamed copy's units and passes, read for its bytes and time when the facts are asked for."""
    seconds: float = 0.0
    """cached: seconds of the pass that computed the log-probabilities (or of reading them back)."""
    cache_file: str | None = None
    """cached: the safetensors file of the training items' log-probabilities."""
    reused: bool = False
    """cached: the file's key matched, so nothing was computed."""
    items: int = 0
    """cached: items whose log-probabilities the file holds."""
    ranks: int = 1
    """cached: processes that shared the pass (each computed a contiguous share of the items)."""

    def facts(self) -> dict[str, Any]:
        """The metrics' record of the reference (the report's task row reads `mode` and `cost`)."""
        facts: dict[str, Any] = {"mode": self.mode, "reason": self.reason, "cost": self.describe_cost()}
        if self.mode == "copy":
            facts["copy_bytes"] = self.copy_bytes
            facts["copy_rank_bytes"] = self.copy_rank_bytes or self.copy_bytes
            if self.copy_sharding:
                facts |= {"copy_sharding": self.copy_sharding, "copy_ranks": self.copy_ranks}
        if self.mode == HOST_COPY and self.stream is not None:
            facts |= self.stream.facts()
        if self.mode == "cached":
            facts |= {"seconds": round(self.seconds, 3), "cache_file": self.cache_file, "reused": self.reused,
                      "items": self.items, "ranks": self.ranks}
        return facts

    def describe_cost(self) -> str:
        if self.mode == "copy" and self.copy_sharding:
            return (f"{self.copy_rank_bytes / 2**20:,.1f} MiB a rank for the frozen copy of"
                    f" {self.copy_bytes / 2**20:,.1f} MiB, sharded over {self.copy_ranks} ranks ({self.copy_sharding}:"
                    " each block's weights gathered only while it runs), one no-grad forward per micro-batch")
        if self.mode == "copy":
            return f"{self.copy_bytes / 2**20:,.1f} MiB for the frozen copy, one no-grad forward per micro-batch"
        if self.mode == "adapters-off":
            return "no copy; one no-grad forward per micro-batch with the adapters disabled"
        if self.mode == HOST_COPY and self.stream is not None:
            return self.stream.describe()
        if self.mode == "cached":
            how = "read back from" if self.reused else "computed into"
            if self.ranks > 1 and not self.reused:
                how = f"computed by {self.ranks} ranks, a share each, into"
            return f"{self.seconds:.1f} s before training ({how} {self.cache_file}); nothing per step"
        return "none"

    def describe(self) -> str:
        """One log line: 'reference: copy (why): cost'."""
        return f"reference: {self.mode} ({self.reason}): {self.describe_cost()}"


# -- the references that run per step ---------------------------------------------------------------------------------


def adapters_off_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                          attention_mask: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """`[rows]` summed log-probabilities of the targets under `model` with its LoRA adapters disabled, no gradient."""
    peft_model = _peft_model(model)
    with torch.no_grad(), peft_model.disable_adapter():
        return sequence_logprobs(model, input_ids, labels, attention_mask, chunk_size=chunk_size).sums


def frozen_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """A frozen copy of `model` where it lies (eval mode, no gradients) and its bytes (weights and buffers)."""
    reference = copy.deepcopy(model, _shared_fake_modes(model)).requires_grad_(False).eval()
    tensors = [*reference.parameters(), *reference.buffers()]
    return reference, sum(t.numel() * t.element_size() for t in tensors)


def reference_copy(model: torch.nn.Module, cost: ReferenceCost) -> torch.nn.Module:
    """The frozen copy of a `copy` or `host-copy` reference (`cost.mode`), made of `model`; `cost` learns its bytes."""
    if cost.mode == HOST_COPY:
        reference, cost.stream = streamed_copy(model)
        return reference
    reference, cost.copy_bytes = frozen_copy(model)
    return reference


def _shared_fake_modes(model: torch.nn.Module) -> dict[int, Any]:
    """A deepcopy memo that keeps the fake-tensor mode of a traced model's tensors shared, not copied.

    A fake tensor (the traced estimate) carries its `FakeTensorMode` in its `__dict__`, which `Tensor.__deepcopy__`
    deep-copies along with it. Copying the mode copies its tensor converter's weak-reference tables, and freeing
    those copies corrupts the heap (a crash at a later garbage collection). The copy's tensors belong to the same
    trace, so they keep the same mode. Real tensors have none: the memo is empty.
    """
    modes = (getattr(tensor, "fake_mode", None) for tensor in [*model.parameters(), *model.buffers()])
    return {id(mode): mode for mode in modes if mode is not None}


def copy_logprobs(reference: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                  attention_mask: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """`[rows]` summed log-probabilities of the targets under the frozen copy `reference` (whole or streamed), no
    gradient."""
    with torch.no_grad(), reference_pass(reference):
        return sequence_logprobs(reference, input_ids, labels, attention_mask, chunk_size=chunk_size).sums


def _peft_model(model: torch.nn.Module) -> Any:
    """The PEFT model inside an engine's or compile's wrappers (DDP's `module`, compile's `_orig_mod`)."""
    seen = model
    for _ in range(8):
        if hasattr(seen, "disable_adapter"):
            return seen
        seen = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if seen is None:
            break
    raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable; the adapters-off reference needs"
                     " --lora-r")


# -- the cached reference ---------------------------------------------------------------------------------------------


def model_fingerprint(model: torch.nn.Module, name: str) -> str:
    """A digest of the model: its name, its config, and each weight's name, shape, dtype and a checksum of its values.

    The checksum (the float64 sum and sum of squares of every element, run on the weights' device a chunk at a time)
    tells apart any two models a run could load under one name (another fine-tune, a re-saved directory) at the cost
    of reading the weights once on the device.
    """
    digest = hashlib.sha256(name.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    names, sums = [], []
    for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        names.append(f"{tensor_name}:{tuple(tensor.shape)}:{tensor.dtype}")
        if tensor.is_meta or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        total = torch.zeros(2, dtype=torch.float64, device=flat.device)
        for chunk in flat.split(_CHECKSUM_CHUNK):
            chunk = chunk.to(torch.float64)
            total += torch.stack([chunk.sum(), chunk.square().sum()])
        sums.append(total)
    digest.update("\n".join(names).encode())
    if sums:  # two numbers a tensor, read from the device in one copy
        digest.update(torch.stack([total.to(sums[0].device) for total in sums]).cpu().numpy().tobytes())
    return digest.hexdigest()


def cache_key(model: str, data: str, settings: dict[str, Any]) -> str:
    """The key of a cached reference: the model's and the data's fingerprints and the settings that change the numbers."""
    return hashlib.sha256(json.dumps({"format": CACHE_FORMAT, "model": model, "data": data, "settings": settings},
                                     sort_keys=True).encode()).hexdigest()


def load_cached(path: Path, key: str, parts: dict[str, Any]) -> tuple[torch.Tensor | None, str]:
    """The log-probabilities stored at `path` when its key is `key`, else None and why not, in words (for the log).

    `parts`: what `key` was made of (cache_key's model, data and settings), to say which of them changed.
    """
    if not path.is_file():
        return None, "none cached yet"
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("key") == key:
                return handle.get_tensor("logps"), "reused"
    except Exception as error:  # a torn or foreign file: recomputed, never trusted
        return None, f"{path.name} is unreadable ({type(error).__name__})"
    stored = json.loads(metadata.get("parts") or "{}")
    changed = [part for part in ("model", "data", "settings") if stored.get(part) != parts.get(part)]
    return None, f"the {' and the '.join(changed) or 'format'} changed since {path.name} was computed"


def save_cached(path: Path, logps: torch.Tensor, key: str, parts: dict[str, Any]) -> None:
    """Write `logps` with its key atomically (a temporary file renamed over `path`): a torn write is never read."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    save_file({"logps": logps.contiguous()}, str(temporary),
              metadata={"key": key, "parts": json.dumps(parts, sort_keys=True)})
    os.replace(temporary, path)


def precompute_logprobs(model: torch.nn.Module, items: int, rows_of: Callable[[int, int], Rows], per_item: int, *,
                        batch_size: int, chunk_size: int, autocast: Callable[[], Any]) -> torch.Tensor:
    """`[items, per_item]` fp32 summed log-probabilities of every item's rows under `model`, in one no-grad pass.

    `rows_of(start, end)`: the host rows of items start..end-1, laid out row-kind major (each item's first row, for
    every item, then each item's second row, ...). Streamed `batch_size` items at a time, halved when a batch runs
    out of memory (down to one item), so only one batch's activations and one chunk of logits are alive. The model
    runs in eval mode (restored after) under `autocast()`, the step's own.
    """
    device = next(model.parameters()).device
    result = torch.empty(items, per_item, dtype=torch.float32)
    was_training = model.training
    model.eval()
    start, size = 0, max(1, batch_size)
    try:
        while start < items:
            end = min(start + size, items)
            try:
                result[start:end] = _item_sums(model, rows_of(start, end), per_item, device, chunk_size, autocast)
            except torch.OutOfMemoryError:
                if size == 1:
                    raise
                size = (size + 1) // 2
                log.warning("memfit: out of memory in the reference pass: %d items a batch now", size)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            start = end
    finally:
        model.train(was_training)
    return result


def item_share(items: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous items [start, end) rank `rank` of `world_size` computes in a shared reference pass."""
    share = -(-items // max(1, world_size))
    start = min(rank * share, items)
    return start, min(start + share, items)


def _item_sums(model: torch.nn.Module, rows: Rows, per_item: int, device: torch.device, chunk_size: int,
               autocast: Callable[[], Any]) -> torch.Tensor:
    input_ids, labels, mask = rows
    with torch.no_grad(), autocast():
        sums = sequence_logprobs(model, input_ids.to(device), labels.to(device),
                                 None if mask is None else mask.to(device), chunk_size=chunk_size).sums
    return sums.float().view(per_item, -1).t().cpu()


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """`work()` and its wall seconds."""
    started = time.perf_counter()
    value = work()
    return value, time.perf_counter() - started

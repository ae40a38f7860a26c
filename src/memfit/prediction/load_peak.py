"""The device and host bytes of loading the model, from the load to the first step.

A training step is not the only moment that can run out of memory: the model is loaded, then the
techniques change it (QLoRA quantizes the fused expert stacks, `--expert-offload` and `--embedding-on-host`
take weights to host memory, `--quantize-head` packs the head). Loaded the plain way, a mixture of experts
holds every expert stack on the device in the load dtype before that: the step's resident weights plus the
difference, gpt-oss-20b's 36 GiB of bf16 experts. memfit's staged load (techniques/staged_weights.py) keeps
those weights in host memory until each takes its final form, so the device holds the step's resident weights
plus one expert stack in the load dtype while it is quantized (plus its NF4 bytes on their way back to host
memory under --expert-offload), and the host holds the loaded model.

Counted here, both ways (which applies is `staged_weights.staging_for`, the rule the loader follows):
- staged: device = the step's resident parameters without the streamed layers in flight + the largest stack
  in the load dtype (QLoRA) [+ its NF4 bytes when they go back to host memory]; host = the loaded model (its
  staged weights in the load dtype, the rest until it moves);
- not staged: device = the model as loaded (experts, embedding and head in the load dtype, adapters made) +
  the first NF4 stack made beside them (QLoRA); host: nothing.
Measured against the tracker on tiny mixtures of experts (tests/unit/techniques/test_staged_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.config import TrainConfig


@dataclass(frozen=True)
class LoadPeak:
    """Bytes the load needs before the first step."""

    device_bytes: int
    """Device peak from the load to the first step (tensors only: the CUDA context is added by the caller)."""
    host_bytes: int
    """Host memory the load passes through (a staged load holds the loaded model there for a moment)."""
    staged: str
    """What a staged load keeps in host memory ('nothing' when the load is not staged)."""


def load_peak(config: TrainConfig, hf_config: Any, world_size: int, loaded_parameters: int, parts: dict[str, Any],
              inventory: Any, lora_r: int, quantize: str, weight_bytes: int) -> LoadPeak:
    """The load's device and host peaks.

    `loaded_parameters`: device bytes of the parameters as loaded (the state parts before the frozen-weight
    techniques); `parts`: the step's state parts (after them).
    """
    from memfit.prediction.experts import expert_stack_sizes, nf4_stack_bytes
    from memfit.resolution.resolve import resolve
    from memfit.techniques.staged_weights import staging_for_run

    staged = staging_for_run(resolve(config, hf_config, "cpu"), hf_config, world_size)
    stacks = expert_stack_sizes(inventory, lora_r) if quantize == "4bit" else []
    largest = max(stacks, default=0)
    if not staged.any:
        return LoadPeak(int(loaded_parameters + (nf4_stack_bytes(largest) if largest else 0)), 0, staged.describe())
    resident = parts["parameters"] - parts.get("experts_streamed_device_bytes", 0)
    transient = largest * weight_bytes  # one stack copied to the device, quantized there, the copy dropped
    if largest and staged.experts_stay_on_host:
        transient += nf4_stack_bytes(largest)  # its NF4 bytes, made on the device, on their way back to host memory
    adapters = 4 * parts.get("trainable_count", 0) if lora_r else 0  # PEFT makes them later, on the device
    return LoadPeak(int(resident + transient), int(loaded_parameters - adapters), staged.describe())

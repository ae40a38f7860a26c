"""The tiled MLP's backward working set: the closed form against a live count of one MLP's backward.

`memfit.prediction.activations.tiled_mlp_backward_bytes` says what a tiled MLP's backward holds on
top of what the block saved. Here a Llama MLP (hidden 128, intermediate 352, 1024 tokens) is
tiled by `memfit.techniques.tiled_mlp`, run forward, and its backward is counted by a dispatch
mode that sees every storage made during it (the input, the output's gradient and the weights
existed before and are left out). The count's peak is the truth.
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.prediction.activations import Precision, architecture_of, tiled_mlp_backward_bytes

HIDDEN, WIDTH, BATCH, SEQ = 128, 352, 2, 512


class _PeakOfNew(TorchDispatchMode):
    """Peak bytes of the storages made under the mode and still alive (`existing` ones left out)."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._existing = {tensor.untyped_storage()._cdata for tensor in existing}

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self._seen and storage._cdata not in self._existing:
                    self._seen.add(storage._cdata)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, storage._cdata, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HIDDEN, intermediate_size=WIDTH, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256)


def _measured_backward_peak(tiles: int, autocast: bool, lora: int, weight_dtype: torch.dtype,
                            trainable: bool = False, efficient_lora: bool = False) -> int:
    from transformers.models.llama.modeling_llama import LlamaMLP

    from memfit.techniques.tiled_mlp import _make_tiled_forward

    torch.manual_seed(0)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = LlamaMLP(_config()).to(weight_dtype)

        def forward(self, hidden):
            return self.mlp(hidden)

    holder = Holder()
    holder.requires_grad_(trainable)
    if lora:
        from peft import LoraConfig, get_peft_model

        holder = get_peft_model(holder, LoraConfig(r=lora, target_modules=["gate_proj", "up_proj", "down_proj"]))
        mlp = holder.base_model.model.mlp
        if efficient_lora:
            from memfit.techniques.efficient_lora import apply_efficient_lora

            assert apply_efficient_lora(holder) == "3 of 3 adapted linears"
    else:
        mlp = holder.mlp
    mlp.forward = types.MethodType(_make_tiled_forward(mlp.forward, tiles), mlp)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, dtype=weight_dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = mlp(hidden)
    grad_output = torch.randn_like(output)
    with _PeakOfNew([hidden, output, grad_output, *holder.parameters()]) as meter:
        output.backward(grad_output)
    return meter.peak


# name: (autocast, LoRA rank, weight dtype, Precision as the estimator resolves these runs[, efficient LoRA])
CASES = {
    "fp32": (False, 0, torch.float32, Precision(4, 4, 4, 0, 4)),
    "bf16 autocast": (True, 0, torch.float32, Precision(2, 4, 4, 0, 2)),
    "LoRA fp32": (False, 8, torch.float32, Precision(4, 4, 4, 8, 4)),
    "LoRA on a bf16 base": (False, 8, torch.bfloat16, Precision(2, 2, 2, 8, 4)),
    "LoRA under bf16 autocast": (True, 8, torch.float32, Precision(2, 4, 4, 8, 2)),
    "efficient LoRA on a bf16 base": (False, 8, torch.bfloat16, Precision(2, 2, 2, 8, 0), True),
}


@pytest.mark.parametrize("tiles", [4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_tiled_mlp_backward_matches_a_live_count(name, tiles, monkeypatch):
    autocast, lora, dtype, precision, *efficient = CASES[name]
    if efficient:
        from memfit.techniques import efficient_lora

        # Slices a twentieth of a tile, as the default slice is to a tile of Llama-3.1-8B's MLP
        # at 80K tokens in 9 tiles: the adapters' fp32 transients stay as small next to the tile.
        monkeypatch.setattr(efficient_lora, "SLICE_ELEMENTS", 4096)
    measured = _measured_backward_peak(tiles, autocast, lora, dtype, efficient_lora=bool(efficient))
    predicted = tiled_mlp_backward_bytes(architecture_of(_config()), precision, BATCH * SEQ, tiles)
    print(f"{name}, {tiles} tiles: predicted {predicted:.0f} B, measured {measured} B")
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


"""How many floating-point operations a training step does, and how many the device could do.

Model FLOPs per token follow the convention of the PaLM paper's MFU (and torchtitan's):
every matmul of the forward counts 2 x its weight's elements per token, attention's two
matmuls (scores and weighted values) count 2 x 2 x seq x attention width per layer over
the full square (a causal kernel skips half, but MFU figures across the field count it
whole), and backward counts twice the forward (input and weight gradients). Norms,
activations, softmax and the optimizer are left out: they are memory-bound and small.

- `model` FLOPs are what the step must do; MFU = model FLOPs per second / device peak.
- `hardware` FLOPs add what memfit chose to redo: the forward of checkpointed blocks
  (full: all of it but the MLP's output projection, whose output nothing saves;
  selective: the cheap ops only, ~5 %), and the output projection of
  the chunked loss, recomputed per chunk in backward. Hardware FLOPs over the peak is the
  hardware FLOPs utilisation (HFU), always >= MFU.
- LoRA: frozen weights need no weight gradient, so their backward is 1 x forward, not 2 x;
  the adapters' own matmuls are counted.
- Mixtures of experts: the MLP counts the experts a token runs (top-k of n, shared experts
  included) and the router: MFU over active parameters, as MoE speed figures are quoted.

The device peak comes from the GPU preset (vendor dense figures, memfit.gpus) or, on a
CPU or an unknown GPU, from a short matmul probe measured once per process.

    >>> from memfit.models.tiny import tiny_config
    >>> flops = flops_per_token(tiny_config(), seq_len=256)
    >>> round(flops.model / 1e6, 1)  # MFLOPs per token of the 3M-parameter model
    20.9
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

CHECKPOINTING_RECOMPUTE = {"off": 0.0, "full": 1.0, "selective": 0.05}
"""Fraction of the blocks' forward FLOPs redone in backward, by checkpointing mode."""


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only transformer that decide its FLOPs."""

    hidden: int
    layers: int
    q_width: int
    """Query width: heads x head dimension (the attention width of the score matmuls)."""
    kv_width: int
    """Key/value width (smaller than q_width under grouped-query attention)."""
    intermediate: int
    vocab: int
    gated_mlp: bool


def shape_of(hf_config: Any) -> Shape:
    """Read the Shape from a transformers config (the Llama family, Qwen, Mistral, GPT-2, GPT-NeoX)."""
    c = hf_config
    if getattr(c, "model_type", "") == "gpt2":
        hidden = c.n_embd
        return Shape(hidden, c.n_layer, hidden, hidden, c.n_inner or 4 * hidden, c.vocab_size, gated_mlp=False)
    hidden = c.hidden_size
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    gated = getattr(c, "model_type", "") not in ("gpt_neox", "gpt_bigcode", "opt", "falcon")
    return Shape(hidden, c.num_hidden_layers, heads * head_dim, kv_heads * head_dim, _active_intermediate(c),
                 c.vocab_size, gated_mlp=gated)


def _active_intermediate(config: Any) -> int:
    """The MLP width one token runs through, averaged over the layers.

    A mixture of experts counts the experts a token is routed to (top-k of n) and the shared ones, not all of
    them, as MFU figures for MoE models do (active parameters); its router adds hidden x experts per token.
    """
    from memfit.models.experts import moe_shape

    moe = moe_shape(config)
    if moe is None:
        return config.intermediate_size
    layers = config.num_hidden_layers
    dense = layers - moe.moe_layers
    per_moe_layer = moe.active_width() + moe.experts / (3 if moe.gated else 2)  # the router's matmul, as MLP width
    return round((dense * config.intermediate_size + moe.moe_layers * per_moe_layer) / layers)


@dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs of one trained token, split the way MFU and HFU need them."""

    forward: float
    """Forward matmuls of the blocks and the output projection, attention included."""
    model: float
    """Forward + backward: the numerator of MFU."""
    hardware: float
    """model + recomputation (checkpointing, chunked loss): the numerator of HFU."""
    block_forward: float
    """The blocks' part of `forward` (full checkpointing redoes all of it but the MLP's last projection)."""
    head_forward: float
    """The output projection's part of `forward` (what the chunked loss redoes)."""


def flops_per_token(
    hf_config: Any,
    seq_len: int,
    *,
    lora_rank: int = 0,
    checkpointing: str = "off",
    chunked_loss: bool = False,
) -> FlopsPerToken:
    """FLOPs of one token of a training step at `seq_len` (pure function of the config).

    Args:
        lora_rank: > 0 when the base weights are frozen (LoRA/QLoRA) and every linear of the
            blocks has adapters of this rank (memfit's default targets): the base's backward
            has no weight gradient, and the first block's projections, which read the frozen
            embedding, no input gradient either.
        checkpointing: off, full or selective; any description starting with one of them
            ("full on 4 of 8 blocks" counts as full on all: use a fraction if it matters).
        chunked_loss: the loss recomputes the output projection per chunk in backward.
    """
    s = shape_of(hf_config)
    # Weight elements of one block's matmuls: q and o at q_width, k and v at kv_width, the MLP.
    attention_weights = s.hidden * (2 * s.q_width + 2 * s.kv_width)
    mlp_weights = (3 if s.gated_mlp else 2) * s.hidden * s.intermediate
    block_dense = 2 * (attention_weights + mlp_weights)
    # Scores (q . k) and weighted values (p . v): 2 FLOPs per multiply-add, over the full square.
    block_attention = 2 * 2 * seq_len * s.q_width
    block_forward = s.layers * (block_dense + block_attention)
    # Non-reentrant checkpointing stops recomputing once every tensor backward needs is back:
    # the MLP's output projection comes last and its output is saved by nothing, so it is skipped.
    block_recompute = block_forward - s.layers * 2 * s.hidden * s.intermediate
    head_forward = 2 * s.hidden * s.vocab
    forward = block_forward + head_forward
    # Backward: gradients of the inputs (1 x forward) and of the weights (1 x forward's dense part).
    # Attention's matmuls have no weights: their backward is 2 x forward either way.
    if lora_rank > 0:
        backward = forward + s.layers * block_attention
        backward -= 2 * s.hidden * (s.q_width + 2 * s.kv_width)  # the first block's q, k and v read no-grad input
        # Adapters: x.A then .B on each linear; backward computes both weight gradients and the input gradient.
        linears = [(s.hidden, s.q_width), (s.hidden, s.kv_width), (s.hidden, s.kv_width), (s.q_width, s.hidden),
                   (s.hidden, s.intermediate), (s.intermediate, s.hidden)]
        if s.gated_mlp:
            linears.append((s.hidden, s.intermediate))
        adapters = s.layers * sum(2 * lora_rank * (fan_in + fan_out) for fan_in, fan_out in linears)
        forward += adapters
        backward += 2 * adapters
    else:
        backward = 2 * forward
    model = forward + backward
    mode = next((m for m in CHECKPOINTING_RECOMPUTE if str(checkpointing).startswith(m)), "off")
    recompute = CHECKPOINTING_RECOMPUTE[mode] * block_recompute + (head_forward if chunked_loss else 0.0)
    return FlopsPerToken(float(forward), float(model), float(model + recompute), float(block_forward),
                         float(head_forward))


# ---------------------------------------------------------------------------
# Device peak
# ---------------------------------------------------------------------------

_PROBED: dict[tuple[str, torch.dtype], float] = {}
PROBE_SIZE = 1024
PROBE_REPEATS = 5
SMALL_PROBE_SIZE = 256
"""The CPU probe's size when the full one would be slow (a dtype the CPU has no instructions for)."""
PROBE_SECONDS = 1.0
"""The longest the full-size CPU probe may be expected to take before the small one is used."""


def probe_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = PROBE_SIZE,
                       repeats: int = PROBE_REPEATS) -> float:
    """FLOP/s of a square matmul on `device`: the best of `repeats` timings, measured once per process.

    The best run, not the mean, stands for the device's peak: on a machine shared with other
    jobs the mean would measure the load. About 0.1 s on 2 CPU cores; kept in memory only
    (memfit writes nothing outside its output directory).
    """
    key = (str(device), dtype)
    if key in _PROBED:
        return _PROBED[key]
    # A generator of its own: drawing from the global one would shift a resumed run's dropout masks.
    generator = torch.Generator(device=device).manual_seed(0)
    if device.type == "cpu" and size > SMALL_PROBE_SIZE:
        size = _affordable_size(dtype, size, repeats, generator)
    a = torch.randn(size, size, device=device, dtype=torch.float32, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, dtype=torch.float32, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm-up: thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    _PROBED[key] = 2 * size**3 / max(best, 1e-9)
    return _PROBED[key]


def _affordable_size(dtype: torch.dtype, size: int, repeats: int, generator) -> int:
    """`size`, or the small probe's when the full one would take over `PROBE_SECONDS`.

    A CPU without native bf16 (AVX2) multiplies bf16 at under 1 GFLOP/s: the 1024 probe took 24 s
    there, paid by every bf16 run's first step. The rate hardly depends on the size (0.68 GFLOP/s
    at 256, 0.76 at 1024), so the small probe measures the same thing in 0.3 s.
    """
    small = torch.randn(SMALL_PROBE_SIZE, SMALL_PROBE_SIZE, generator=generator).to(dtype)
    started = time.perf_counter()
    torch.matmul(small, small)
    expected = (time.perf_counter() - started) * (size / SMALL_PROBE_SIZE) ** 3 * (repeats + 1)
    return size if expected <= PROBE_SECONDS else SMALL_PROBE_SIZE


@dataclass(frozen=True)
class DevicePeak:
    flops_per_second: float
    source: str
    """Where the figure comes from ('preset h100-80gb bf16', 'matmul probe fp32 on cpu')."""


def device_peak(device: torch.device, compute_dtype: torch.dtype | None = None) -> DevicePeak:
    """The peak FLOP/s a step in `compute_dtype` (None: fp32) can reach on `device`.

    CUDA: the GPU preset matching the card's name (bf16/fp16 tensor-core or fp32 dense
    figures); a card without a preset, and every CPU, gets a matmul probe.
    """
    dtype = compute_dtype or torch.float32
    label = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if device.type == "cuda":
        from memfit.errors import UsageError
        from memfit.gpus import get_gpu, preset_name_of

        name = torch.cuda.get_device_name(device)
        try:
            spec = get_gpu(preset_name_of(name, torch.cuda.get_device_properties(device).total_memory))
        except UsageError:
            spec = None
        if spec is not None:
            tflops = {"bf16": spec.peak_tflops_bf16_dense, "fp16": spec.peak_tflops_fp16_dense}.get(
                label, spec.peak_tflops_fp32_dense
            )
            if tflops > 0:
                return DevicePeak(tflops * 1e12, f"preset {spec.name} {label}")
    return DevicePeak(probe_matmul_flops(device, dtype), f"matmul probe {label} on {device.type}")


def utilisation(tokens: int, seconds: float, flops: FlopsPerToken, peak: DevicePeak) -> dict[str, float]:
    """`mfu` and `hfu` of a step that trained `tokens` in `seconds` (fractions of the peak)."""
    rate = tokens / max(seconds, 1e-9)
    return {
        "mfu": rate * flops.model / peak.flops_per_second,
        "hfu": rate * flops.hardware / peak.flops_per_second,
    }

"""Closed forms for the bytes a transformer keeps for backward.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models") count the tensors each block saves for backward; the same counting is done
here for the block kinds Hugging Face models use, per token of a micro-batch:

- norm: RMSNorm (Llama family) keeps its fp32 input, the normalised tensor and the
  linear's input (memfit's efficient RMSNorm: its input, the fp32 1/rms and the linear's
  input); LayerNorm (GPT-2) keeps its input, mean and 1/std and the linear's input.
- attention: Q, K, V (grouped-query: K and V at the KV-head width), the output and
  the fp32 log-sum-exp for SDPA/flash; eager attention also keeps the
  [heads, s, s] probabilities (fp32 softmax, plus its compute-dtype copy).
- MLP: gated (SwiGLU/GeGLU) keeps gate, up, act(gate) and their product (4 x width);
  GELU keeps the first projection's output and the activation's intermediates.
- dropout (p > 0) keeps a one-byte mask per element.

Dtypes follow what autocast does: matmul inputs and outputs in the compute dtype, the
residual stream and norm statistics in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Architecture:
    """The numbers of a decoder-only transformer that decide its activation bytes."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    rms_norm: bool
    gelu_intermediates: int
    """Tensors of width `intermediate` the MLP activation keeps (1 for a fused GELU, 4 for GPT-2's gelu_new)."""
    dropout: float
    attention_dropout: float
    tied_embeddings: bool
    learned_positions: bool
    fused_qkv: bool = False
    """Q, K and V come from one projection (GPT-2's c_attn, Phi-3's qkv_proj)."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def architecture_of(hf_config: Any) -> Architecture:
    """Read the Architecture from a transformers config (GPT-2 or the Llama family)."""
    c = hf_config
    if c.model_type == "gpt2":
        hidden = c.n_embd
        activation = getattr(c, "activation_function", "gelu_new")
        return Architecture(
            "gpt2", hidden, c.n_layer, c.n_head, c.n_head, hidden // c.n_head, c.n_inner or 4 * hidden,
            c.vocab_size, gated_mlp=False, rms_norm=False,
            gelu_intermediates=4 if activation == "gelu_new" else 1,
            dropout=float(c.resid_pdrop), attention_dropout=float(c.attn_pdrop),
            tied_embeddings=bool(getattr(c, "tie_word_embeddings", True)), learned_positions=True, fused_qkv=True,
        )
    hidden = c.hidden_size
    # a state-space family (Mamba-2) may have no attention heads: its blocks are probed, these numbers only
    # size the closed forms' side terms
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "num_heads", None) or 1
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    intermediate = getattr(c, "intermediate_size", None) or getattr(c, "ffn_hidden_size", None) or 4 * hidden
    return Architecture(
        c.model_type, hidden, c.num_hidden_layers, heads, getattr(c, "num_key_value_heads", None) or heads,
        head_dim, intermediate, c.vocab_size, gated_mlp=True, rms_norm=True, gelu_intermediates=0,
        dropout=float(getattr(c, "resid_pdrop", 0.0) or 0.0),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)), learned_positions=False,
        fused_qkv=c.model_type == "phi3",
    )


CLOSED_FORM_FAMILIES = frozenset({"llama", "mistral", "qwen2", "phi3", "gpt2"})
"""Model types whose blocks the closed forms describe (checked in docs/accuracy.md); other
families' blocks are measured by `memfit.prediction.layer_probe`."""


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the tensors a step keeps."""

    compute: int
    """Matmul inputs/outputs: 2 under bf16/fp16 autocast or 16-bit weights, else 4."""
    residual: int
    """The residual stream: the weights' dtype (fp32 master weights under autocast)."""
    attention: int = 0
    """Q, K, V and output of attention; 0 means `compute`. CPU autocast runs SDPA on the fp32 RoPE output."""
    lora_rank: int = 0
    """With LoRA the frozen norms keep less and each adapted linear keeps its rank-r activation."""
    adapter_input: int = 4
    """Bytes per element of the copy of its input an adapter keeps on a 16-bit base: PEFT casts the
    input to the fp32 adapter's dtype (4); under autocast the adapter's matmul saves its 16-bit cast (2);
    memfit's adapter path keeps the input itself (0: techniques/efficient_lora.py)."""
    efficient_norm: bool = False
    """RMSNorm keeps only its input and the fp32 1/rms (memfit.techniques.rms_norm), not the fp32
    upcast and the normalised tensor."""


def mlp_bytes_per_token(arch: Architecture, precision: Precision) -> float:
    """What the MLP of one block keeps for backward beyond its input, per token (the part tiling divides)."""
    c = precision.compute
    mlp = 4 * c * arch.intermediate if arch.gated_mlp else c * arch.intermediate * (1 + arch.gelu_intermediates)
    if precision.lora_rank and c == 2 and precision.residual == 2:
        mlp += precision.adapter_input * arch.intermediate  # the adapter's copy of the down projection's input
    return mlp


def tiled_mlp_backward_bytes(arch: Architecture, precision: Precision, tokens: int, tiles: int) -> float:
    """What a tiled MLP's backward holds on top of the block's saved tensors, for `tokens` tokens.

    Counted with a live-storage dispatch mode around one tiled MLP's backward (torch 2.13, CPU;
    fp32, bf16 autocast, LoRA on fp32 and on 16-bit bases; tests/unit/memory/test_tiled_mlp_memory.py):
    `memfit.techniques.tiled_mlp` allocates the input's gradient whole before the first tile and
    fills it tile by tile (tokens x hidden in the input's dtype, whatever the number of tiles).
    Each tile is then recomputed with a graph: its saved intermediates (gate, up, act(gate),
    their product, and on a 16-bit base the adapter's fp32 copy of the down projection's input)
    are the tile's share of `mlp_bytes_per_token`, and autograd forms two intermediate-wide
    gradients while they are live: 1.5 x that share (on a 16-bit base with LoRA the peak comes
    during the recompute, 1 x; memfit's adapter path keeps no fp32 copies, and the peak
    is backward's again). Hidden-wide, per tile: the tile's input gradient, and with LoRA
    the adapters' fp32 copies of the tile's input and their gradients (memfit's adapter path:
    the gate and up adapters' input gradients in the input's dtype);
    under autocast the tile's 16-bit casts of its input, the three weights' 16-bit casts (the
    autocast cache is off in backward, so each tile casts them again) and, with LoRA, the
    adapter's fp32 copy of the down projection's input. The earlier figure, two tiles' share,
    matched fp32 by chance (its extra half tile stood in for the whole-sequence input gradient)
    and fell short where the MLP's share is small next to that gradient: many tiles, 16-bit
    intermediates with fp32 adapters (the bf16 QLoRA run).
    """
    tile = tokens / tiles
    h, width = arch.hidden, arch.intermediate
    autocast = precision.compute == 2 and precision.residual == 4
    sixteen_bit_base = precision.lora_rank and precision.residual == 2
    # on a 16-bit base the peak comes at the recompute, before the intermediate gradients exist
    per_tile_token = (1.0 if sixteen_bit_base else 1.5) * mlp_bytes_per_token(arch, precision) + precision.residual * h
    if precision.lora_rank and sixteen_bit_base and precision.adapter_input == 0:
        # memfit's adapter path: no fp32 copies, so the peak is backward's (the intermediate
        # gradients live); the gate and up adapters' input gradients in the input's dtype
        per_tile_token += (1.5 - 1.0) * mlp_bytes_per_token(arch, precision) + 2 * precision.compute * h
    elif precision.lora_rank:
        # PEFT's fp32 copies of the tile's input (gate, up) and their gradients
        per_tile_token += (4 if sixteen_bit_base else 3) * 4 * h
    weights = 0.0
    if autocast:
        per_tile_token += 2 * 2 * h  # the 16-bit casts of the tile's input for gate and up
        weights = 2 * 3 * h * width
        if precision.lora_rank:
            per_tile_token += 4 * width  # PEFT's fp32 copy of the down projection's 16-bit input
    return per_tile_token * tile + precision.residual * h * tokens + weights


def norm_module_bytes_per_token(arch: Architecture, precision: Precision) -> float:
    """What a block's two norms keep themselves, per token (the linears' inputs they feed aside).

    RMSNorm: the fp32 upcast of its input, the fp32 1/rms and, when its weight trains, the
    normalised tensor (residual dtype); memfit's efficient RMSNorm its input and the 1/rms.
    LayerNorm: its input, mean and 1/std. On an fp32 residual stream (fp32 weights, with
    autocast or without) the norms run in fp32 and keep the same bytes either way.
    """
    r, h = precision.residual, arch.hidden
    if arch.rms_norm and precision.efficient_norm:
        one = r * h + 4
    elif arch.rms_norm:
        one = 4 * h + (0 if precision.lora_rank > 0 else r * h) + 4
    else:
        one = r * h + 8
    return 2 * one


def layer_bytes_per_token(arch: Architecture, precision: Precision, attention: str, seq_len: int,
                          mlp_tiles: int = 0) -> float:
    """Bytes one block keeps for backward, per token of the micro-batch.

    `mlp_tiles` > 1: the MLP runs each tile without keeping anything but its input (the
    norm's output, counted with the norm); one tile's intermediates exist at a time, in
    forward and again in backward (`activation_bytes` adds them to the backward peak).
    """
    c, r = precision.compute, precision.residual
    a = precision.attention or c
    h = arch.hidden
    frozen = precision.lora_rank > 0
    norm = norm_module_bytes_per_token(arch, precision) / 2 + c * h  # each norm, and the linear's input
    # Q, K, V as SDPA receives them; GQA keeps K and V narrow except in eager, which repeats them.
    kv = arch.kv_width if attention != "eager" else arch.q_width
    if arch.fused_qkv and arch.rms_norm:
        # Q and K after RoPE, the output; V is a view of the fused QKV output, kept whole
        attention_bytes = a * (arch.q_width + kv + arch.q_width) + c * (arch.q_width + 2 * arch.kv_width)
    else:
        attention_bytes = a * (arch.q_width + 2 * kv + arch.q_width)  # Q, K, V and the attention output
    attention_bytes += c * arch.q_width  # o_proj's input
    attention_bytes += 4 * arch.heads  # log-sum-exp of the flash/efficient kernels
    probabilities = arch.heads * seq_len
    if arch.attention_dropout > 0 and attention != "eager":
        # SDPA with dropout takes the math path: fp32 softmax output, float dropout mask, dropped probabilities
        attention_bytes += probabilities * 12
    elif attention == "eager":
        attention_bytes += probabilities * (4 + (c if c != 4 else 0))
        if arch.attention_dropout > 0:
            attention_bytes += probabilities * (1 + c)
    mlp = mlp_bytes_per_token(arch, precision) if mlp_tiles <= 1 else 0.0
    dropout = 2 * h if arch.dropout > 0 else 0  # masks after attention and after the MLP
    adapters = 7 * 4 * precision.lora_rank if frozen else 0  # lora_A outputs kept for lora_B
    if frozen and c == 2 and r == 2:
        # 16-bit base: each adapter keeps a copy of its input in its own dtype (the down
        # projection's copy is counted with the MLP, which tiling divides)
        adapters += precision.adapter_input * 3 * h
    return 2 * norm + attention_bytes + mlp + dropout + adapters


def checkpointed_layer_bytes_per_token(arch: Architecture, precision: Precision) -> float:
    """What a fully checkpointed block keeps: its input (the residual stream).

    A block's output is the next block's input, so each block adds one residual-stream tensor,
    with LoRA and without (tracked: 8 checkpointed Llama blocks, bf16 weights and fp32 under
    autocast, and the 32-block Llama-3.1-8B shape at 1/1024 scale keep one tensor per block; the
    last block's output is the final norm's input, counted with the model's edges).
    """
    return precision.residual * arch.hidden + (arch.hidden if arch.dropout > 0 else 0)


def selective_layer_bytes_per_token(arch: Architecture, precision: Precision) -> float:
    """Selective checkpointing keeps the matmul and attention outputs, recomputes the rest."""
    c = precision.compute
    matmul_outputs = arch.q_width + 2 * arch.kv_width + arch.hidden + 2 * arch.intermediate + arch.hidden
    return c * (matmul_outputs + arch.q_width) + 4 * arch.heads + precision.residual * arch.hidden


def model_edge_bytes_per_token(arch: Architecture, precision: Precision) -> float:
    """Outside the blocks, live at the loss: the output head's input, input ids and labels."""
    dropout = arch.hidden if arch.dropout > 0 else 0
    return precision.compute * arch.hidden + dropout + 16


def offloaded_head_bytes(arch: Architecture, precision: Precision, tokens: int, unchunked_loss: bool) -> float:
    """What activation offload copies to host memory outside the blocks: the final norm, the head and the loss.

    Counted from the tensors `memfit.techniques.offload.ActivationOffload` copies (torch 2.13, CPU; bf16, fp32
    and bf16 autocast over fp32 weights, with LoRA and without; tests/unit/prediction/test_offload_bytes.py):
    the final norm's input (memfit's efficient RMSNorm; Hugging Face's RMSNorm keeps its fp32 upcast and, when
    its weight trains, the normalised tensor instead) and the head's input. The chunked loss keeps the
    normalised hidden states (in the residual dtype) as its chunks' inputs. The unchunked loss keeps the head's
    input in the compute dtype (a frozen LoRA head keeps none), under autocast the head weight's 16-bit cast,
    and the fp32 log-softmax for backward: 4 bytes per token and vocabulary entry whatever the compute dtype
    (counted at the compute dtype's 2 bytes, a Llama-3.2-1B step at 4,096 tokens moved 1,002 MiB each way
    more than the estimate on an H100).
    """
    r, c, h = precision.residual, precision.compute, arch.hidden
    if arch.rms_norm and precision.efficient_norm:
        norm = r * h
    elif arch.rms_norm:
        norm = 4 * h + (0 if precision.lora_rank else r * h)
    else:
        norm = 2 * r * h
    if not unchunked_loss:
        return (norm + r * h) * tokens
    head_input = 0 if precision.lora_rank else c * h
    return (norm + head_input) * tokens + offloaded_loss_bytes(arch, precision, tokens)


def offloaded_loss_bytes(arch: Architecture, precision: Precision, tokens: int) -> float:
    """What the unchunked loss saves for backward: the fp32 log-softmax and, under autocast, the head weight's cast."""
    weight_cast = precision.compute * arch.vocab * arch.hidden if precision.compute == 2 and precision.residual == 4 else 0
    return 4.0 * arch.vocab * tokens + weight_cast


def logits_bytes(arch: Architecture, tokens: int, chunk_tokens: int, compute_bytes: int = 4,
                 fused: bool = False) -> float:
    """Peak bytes of the output projection + cross-entropy.

    Unchunked: the logits in the compute dtype, their flattened copy, the fp32 copy and
    the fp32 log-softmax kept for backward, then as much again for the gradients:
    about 12 bytes per token and vocabulary entry at the peak. Chunked: one chunk's
    logits in the compute dtype, their fp32 copy (16-bit compute only) and log-softmax,
    and in backward the chunk's fp32 logit gradient: 14 bytes per chunk token and
    vocabulary entry in 16 bits, 12 in fp32.
    Fused (liger-kernel's linear cross-entropy): no logits kept; it computes the input's
    gradient in forward (tokens x hidden x 4) and works on chunks of about
    tokens x hidden / vocabulary tokens, one fp32 chunk of logits at a time.
    """
    if fused:
        return 2.0 * 4 * tokens * arch.hidden
    if chunk_tokens > 0 and chunk_tokens < tokens:
        upcast = 4 if compute_bytes != 4 else 0  # fp32 logits need no fp32 copy
        return (compute_bytes + upcast + 8.0) * chunk_tokens * arch.vocab
    return 12.0 * tokens * arch.vocab


class ActivationTerms(NamedTuple):
    """Activation bytes of a micro-batch, split by where they live and when."""

    kept: float
    """On the device at the end of forward."""
    recompute: float
    """Extra device bytes while one block is recomputed (or brought back) in backward."""
    per_layer: float
    """Bytes one uncheckpointed block keeps."""
    released_per_block: float
    """Device bytes each block's backward frees (0 when they live in host memory)."""
    host: float = 0.0
    """Bytes kept in host memory (activation offload)."""


def activation_bytes(
    arch: Architecture,
    precision: Precision,
    *,
    batch_size: int,
    seq_len: int,
    attention: str,
    checkpointing: str,
    checkpoint_every: int = 1,
    mlp_tiles: int = 0,
    offload: bool = False,
    layer_per_token: float | None = None,
    unchunked_loss: bool = False,
) -> ActivationTerms:
    """Activation bytes of a micro-batch.

    Args:
        mlp_tiles: the MLP runs over this many sequence tiles (tiled MLP): its
            intermediates are one tile's worth, in forward and in its backward.
        offload: activation offload. With checkpointing each checkpointed block's input
            (and the saved tensors of blocks that are not checkpointed) live in host
            memory; the device holds the block being worked on and the one being copied:
            two blocks' inputs. Without checkpointing every saved tensor goes to host; the
            device holds the two largest in flight, and in backward one block's worth.
        unchunked_loss: the plain loss runs (under offload its fp32 log-softmax goes to host memory:
            `offloaded_head_bytes`).
        layer_per_token: bytes one uncheckpointed block keeps per token, when measured
            from the model itself (`memfit.prediction.layer_probe`) instead of the closed form.
    """
    tokens = batch_size * seq_len
    per_token = layer_per_token if layer_per_token is not None else layer_bytes_per_token(
        arch, precision, attention, seq_len)
    mlp = mlp_bytes_per_token(arch, precision)
    tile_backward = 0.0
    if mlp_tiles > 1:
        # the MLP keeps only its input; its backward recomputes one tile at a time
        per_token -= mlp if layer_per_token is not None else 0.0
        if layer_per_token is None:
            per_token = layer_bytes_per_token(arch, precision, attention, seq_len, mlp_tiles)
        tile_backward = tiled_mlp_backward_bytes(arch, precision, tokens, mlp_tiles)
    full_layer = max(per_token, 0.0) * tokens
    edges = model_edge_bytes_per_token(arch, precision) * tokens
    checkpointed_blocks = 0
    if checkpointing == "off":
        kept_one, recompute, blocks_kept = full_layer, tile_backward, arch.layers * full_layer
    elif checkpointing == "selective":
        kept_one = selective_layer_bytes_per_token(arch, precision) * tokens
        recompute, blocks_kept = full_layer - kept_one + tile_backward, arch.layers * kept_one
    else:
        checkpointed = checkpointed_blocks = math.ceil(arch.layers / max(1, checkpoint_every))
        kept_one = checkpointed_layer_bytes_per_token(arch, precision) * tokens
        # One block is recomputed at a time in backward: its full activations come back.
        recompute = full_layer + tile_backward
        blocks_kept = checkpointed * kept_one + (arch.layers - checkpointed) * full_layer
    if not offload:
        return ActivationTerms(blocks_kept + edges, recompute, full_layer, kept_one)
    ids_and_labels = 16 * tokens
    host = blocks_kept + edges - ids_and_labels
    if checkpointed_blocks:
        # Offloaded checkpoints: one input per checkpointed block (the residual stream), the
        # tensors of blocks left uncheckpointed, and what the final norm, the head and the loss
        # save outside the blocks (`offloaded_head_bytes`).
        block_input = precision.residual * arch.hidden * tokens
        uncheckpointed = blocks_kept - checkpointed_blocks * kept_one
        host = (checkpointed_blocks * block_input + uncheckpointed
                + offloaded_head_bytes(arch, precision, tokens, unchunked_loss))
    elif unchunked_loss:  # the head's input is among the edges; what the loss saves is not
        host += offloaded_loss_bytes(arch, precision, tokens)
    if checkpointing == "off":
        largest = precision.compute * max(arch.intermediate / max(1, mlp_tiles), arch.q_width) * tokens
        # In backward the saved tensors come back one operation ahead of use: the peak is the
        # MLP's backward, its tensors and half of them again as gradients, plus the hidden-wide
        # gradient in and out (measured on CPU with the tracker).
        working = (1.5 * mlp / max(1, mlp_tiles) + 2 * precision.compute * arch.hidden) * tokens
        # (the forward's two copies in flight are gone by then: backward holds the working set alone)
        in_flight = 2 * largest
        return ActivationTerms(in_flight + ids_and_labels, max(0.0, working + tile_backward - in_flight), full_layer,
                               0.0, host)
    return ActivationTerms(2 * kept_one + ids_and_labels, recompute, full_layer, 0.0, host)


def flash_backward_workspace_bytes(arch: Architecture, precision: Precision, tokens: int, attention: str,
                                   device_type: str) -> float:
    """What the flash kernel's backward allocates for itself while one block's attention backward runs (CUDA).

    FlashAttention-2's backward (PyTorch's SDPA flash path and the flash-attn package) accumulates dQ in fp32,
    4 bytes per query element, and under grouped-query attention it computes dK and dV at the query heads'
    width before summing them to the key-value heads. At 2,048 tokens this is noise; at 131,072 tokens of
    Llama-3.1-8B it is 4 GiB, what an H100 run of four blocks measured above the estimate (docs/benchmarks.md,
    "Estimator against the CUDA allocator"). CPU kernels and 32-bit attention (the memory-efficient kernel)
    allocate no such buffers. FlexAttention's backward (gpt-oss on CUDA) is counted alike, unmeasured.
    """
    a = precision.attention or precision.compute
    if device_type != "cuda" or attention not in ("sdpa", "flash_attention_2", "flex") or a != 2:
        return 0.0
    dq_accumulator = 4 * arch.q_width
    expanded_dk_dv = 2 * a * arch.q_width if arch.kv_heads < arch.heads else 0
    return float((dq_accumulator + expanded_dk_dv) * tokens)

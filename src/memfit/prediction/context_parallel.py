"""Per-rank peak memory and all-to-all traffic of a context-parallel (Ulysses) run, on paper.

Under ``--context-parallel N`` every sequence is split into N contiguous shards, one per
rank of a context group. Everything outside attention (norms, MLP, the loss, the saved
block inputs) sees seq/N tokens; attention sees the whole sequence on heads/N after an
all-to-all of q, k, v (and back for its output). Weights, gradients and optimizer state
are sharded by FSDP2 over dp x cp ranks. This module prices those terms from the model's
shape alone, so the planner can search context-parallel sizes before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memfit.errors import UsageError

GIB = 1024 ** 3

# Per-direction link bandwidth a rank sees, GB/s.
# NVLink 4 on H100/H200 SXM: 900 GB/s bidirectional per GPU (NVIDIA H100 data sheet) -> 450 one way.
# InfiniBand NDR: 400 Gb/s per GPU's adapter (NVIDIA ConnectX-7 data sheet) -> 50 GB/s one way.
NVLINK4_GBPS = 450.0
INFINIBAND_NDR_GBPS = 50.0
GPUS_PER_NODE = 8
"""Ranks one NVLink domain holds (an HGX H100 board); context groups larger than this cross InfiniBand."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that the per-rank estimate needs."""

    layers: int
    """Decoder blocks."""
    hidden: int
    """Hidden size (the residual stream's width)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    intermediate: int
    """MLP width."""
    vocab: int
    """Vocabulary size (the logits' width)."""
    parameters: int
    """Total trainable parameters (full fine-tune)."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


@dataclass(frozen=True)
class Levers:
    """memfit's long-context levers, as the per-rank estimate counts them."""

    checkpointing: bool = True
    """Keep only each block's input for backward and recompute the block."""
    offload_checkpoints: bool = False
    """Keep those block inputs in host memory instead of the GPU's."""
    mlp_tiles: int = 1
    """Split the MLP's sequence into this many tiles (tiled MLP); 1 = untiled."""
    loss_chunk: int = 0
    """Tokens per chunk of the chunked loss (logits never whole); 0 = whole logits."""


@dataclass(frozen=True)
class PerRankEstimate:
    """One rank's peak under context parallelism, by term, in bytes."""

    seq_len: int
    """Whole sequence length (tokens per sample)."""
    context_parallel: int
    """Ranks one sequence is split over (N)."""
    data_parallel: int
    """Context groups (world size / N)."""
    terms: dict[str, float] = field(default_factory=dict)
    """Device bytes per term: model_state, gathered_layer, saved_activations, layer_working, attention, all_to_all, loss."""
    host_bytes: float = 0.0
    """Host memory this rank needs (offloaded block inputs)."""

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of each sequence this rank holds outside attention."""
        return self.seq_len // self.context_parallel

    @property
    def peak_bytes(self) -> float:
        """Device peak: the sum of the terms (they are live together at the last layer's backward)."""
        return sum(self.terms.values())

    def summary(self) -> str:
        """One line naming the split and the per-rank peak."""
        return (f"per rank: {self.peak_bytes / GIB:.2f} GiB on the GPU, {self.host_bytes / GIB:.2f} GiB host; "
                f"split: {self.data_parallel} data-parallel x {self.context_parallel} context-parallel (Ulysses), "
                f"{self.tokens_per_rank} of {self.seq_len} tokens per rank")


def context_parallel_refusal(shape: ModelShape, cp: int, seq_len: int, mode: str = "ulysses") -> str | None:
    """Why this split cannot run (one line), or None."""
    if mode == "ring":
        return "--context-parallel-mode ring is not wired yet; use ulysses"
    if cp < 1:
        return f"--context-parallel must be at least 1, got {cp}"
    if shape.heads % cp:
        return f"Ulysses needs the {shape.heads} attention heads to divide by --context-parallel {cp}; pick a divisor of {shape.heads}"
    if seq_len % cp:
        return f"the sequence length {seq_len} must divide by --context-parallel {cp}"
    return None


def _model_state(shape: ModelShape, shards: int) -> tuple[float, float]:
    """FSDP2-sharded state and one layer's gathered bf16 weights (two in flight: current and prefetched)."""
    # bf16 weights (2) + bf16 gradients (2) + fp32 master (4) + AdamW m and v (8): 16 bytes a parameter
    state = shape.parameters * 16 / shards
    layer_parameters = (shape.parameters - 2 * shape.vocab * shape.hidden) / shape.layers
    return state, 2 * layer_parameters * 2


def _attention_bytes(shape: ModelShape, seq_len: int, cp: int) -> tuple[float, float]:
    """Attention at the whole sequence on heads/N, and the all-to-all buffers (bf16)."""
    local_heads = shape.heads // cp
    per_full_tensor = seq_len * local_heads * shape.head_dim * 2
    # q, k, v, out at full length (k, v repeated per query head before the exchange), the flash
    # backward's fp32 dQ accumulator (2x a bf16 tensor) and dK, dV at the query width.
    attention = per_full_tensor * (4 + 2 + 2)
    # q, k, v and the output as [seq/N, heads, head_dim] send/receive buffers, live together.
    all_to_all = 4 * (seq_len // cp) * shape.heads * shape.head_dim * 2
    return attention, all_to_all


def per_rank_estimate(shape: ModelShape, seq_len: int, cp: int, world_size: int, levers: Levers = Levers(),
                      *, mode: str = "ulysses") -> PerRankEstimate:
    """One rank's peak for a batch of one sequence of seq_len tokens, split over cp ranks."""
    refusal = context_parallel_refusal(shape, cp, seq_len, mode)
    if refusal:
        raise UsageError(refusal)
    if world_size % cp:
        raise UsageError(f"the world size {world_size} must divide by --context-parallel {cp}")
    tokens = seq_len // cp
    state, gathered = _model_state(shape, world_size)
    block_input = tokens * shape.hidden * 2
    if levers.checkpointing:
        saved = shape.layers * block_input
        working_per_token = 16 * shape.hidden + 3 * shape.intermediate * 2 / max(1, levers.mlp_tiles)
    else:
        saved = shape.layers * tokens * (16 * shape.hidden + 3 * shape.intermediate * 2)
        working_per_token = 0.0
    host = 0.0
    if levers.offload_checkpoints and levers.checkpointing:
        host, saved = saved, 2 * block_input  # one block input in flight each way
    attention, all_to_all = _attention_bytes(shape, seq_len, cp)
    logits_tokens = min(tokens, levers.loss_chunk) if levers.loss_chunk else tokens
    loss = logits_tokens * shape.vocab * (2 + 4 + 4)  # bf16 logits, fp32 upcast and its gradient
    terms = {"model_state": state, "gathered_layer": gathered, "saved_activations": saved,
             "layer_working": tokens * working_per_token, "attention": attention, "all_to_all": all_to_all,
             "loss": loss}
    return PerRankEstimate(seq_len, cp, world_size // cp, terms, host)


def link_gbps(context_group_spans_nodes: bool) -> float:
    """Per-direction bandwidth of the link a context group's all-to-all crosses."""
    return INFINIBAND_NDR_GBPS if context_group_spans_nodes else NVLINK4_GBPS


def all_to_all_bytes_per_step(shape: ModelShape, seq_len: int, cp: int) -> float:
    """Bytes one rank sends per step: 4 all-to-alls a layer forward (q, k, v, out), 4 backward,
    each moving (N-1)/N of a [seq/N, hidden] bf16 tensor (recomputation under checkpointing adds 4 more)."""
    if cp == 1:
        return 0.0
    one = (cp - 1) / cp * (seq_len // cp) * shape.hidden * 2
    return shape.layers * 8 * one


def all_to_all_seconds(shape: ModelShape, seq_len: int, cp: int, checkpointing: bool = True) -> float:
    """Time one step spends in the all-to-all traffic over the context group's link."""
    moved = all_to_all_bytes_per_step(shape, seq_len, cp) * (1.5 if checkpointing else 1.0)
    return moved / (link_gbps(cp > GPUS_PER_NODE) * 1e9)


def longest_seq_len(shape: ModelShape, cp: int, world_size: int, levers: Levers, device_bytes: float,
                    host_bytes: float, step: int = 1024) -> int:
    """The longest multiple of step (and of cp) whose per-rank estimate fits the device and the host; 0 if none."""
    unit = step * cp // _gcd(step, cp)
    low, high = 0, unit
    fits = lambda s: _fits(shape, s, cp, world_size, levers, device_bytes, host_bytes)  # noqa: E731
    while fits(high) and high < 1 << 27:
        low, high = high, high * 2
    while high - low > unit:
        middle = (low + high) // 2 // unit * unit
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _fits(shape, seq_len, cp, world_size, levers, device_bytes, host_bytes) -> bool:
    estimate = per_rank_estimate(shape, seq_len, cp, world_size, levers)
    return estimate.peak_bytes <= device_bytes and estimate.host_bytes <= host_bytes


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass(frozen=True)
class ContextParallelPlan:
    """The longest context one split and lever set reaches on paper."""

    seq_len: int
    """Longest sequence that fits."""
    estimate: PerRankEstimate
    """The per-rank estimate at that length."""
    levers: Levers
    """Levers the plan turns on."""
    all_to_all_seconds: float
    """Step time spent in the all-to-all traffic."""


def plan_context_parallel(shape: ModelShape, gpus: int, device_bytes: float, host_bytes: float) -> list[ContextParallelPlan]:
    """For every context-parallel size (divisors of gpus that divide the heads) the longest context, longest first."""
    lever_sets = [Levers(), Levers(mlp_tiles=8, loss_chunk=4096),
                  Levers(offload_checkpoints=True, mlp_tiles=8, loss_chunk=4096)]
    plans = []
    for cp in [d for d in range(1, gpus + 1) if gpus % d == 0 and shape.heads % d == 0]:
        for levers in lever_sets:
            seq_len = longest_seq_len(shape, cp, gpus, levers, device_bytes, host_bytes)
            if seq_len:
                plans.append(ContextParallelPlan(seq_len, per_rank_estimate(shape, seq_len, cp, gpus, levers),
                                                 levers, all_to_all_seconds(shape, seq_len, cp)))
    return sorted(plans, key=lambda plan: (-plan.seq_len, plan.all_to_all_seconds))


def shape_from_hf_config(hf_config, parameters: int) -> ModelShape:
    """A ModelShape from a transformers config and the model's parameter count."""
    heads = hf_config.num_attention_heads
    return ModelShape(hf_config.num_hidden_layers, hf_config.hidden_size, heads,
                      getattr(hf_config, "num_key_value_heads", None) or heads,
                      hf_config.intermediate_size, hf_config.vocab_size, parameters)


def decoder_parameters(shape: ModelShape, tied: bool) -> int:
    """Parameters of a Llama-style decoder from its shape (embedding, blocks, final norm, head)."""
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * shape.head_dim
    block = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    return shape.layers * block + shape.vocab * shape.hidden * (1 if tied else 2) + shape.hidden


def levers_of(config) -> Levers:
    """The long-context levers a TrainConfig turns on, as the per-rank estimate counts them."""
    memory = config.memory
    return Levers(checkpointing=memory.gradient_checkpointing != "off",
                  offload_checkpoints=bool(memory.activation_offload),
                  mlp_tiles=max(1, memory.tiled_mlp or 1),
                  loss_chunk=memory.loss_chunk_size or 0)


def estimate_from_config(config, world_size: int) -> PerRankEstimate:
    """The per-rank estimate of a config's --context-parallel split (a full fine-tune, batch of one sequence)."""
    from memfit.models.presets import resolve_model_config

    hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    shape = shape_from_hf_config(hf_config, 0)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    shape = shape_from_hf_config(hf_config, decoder_parameters(shape, tied))
    distributed = config.distributed
    return per_rank_estimate(shape, config.data.seq_len_or_default, distributed.context_parallel, world_size, levers_of(config),
                             mode=distributed.context_parallel_mode)

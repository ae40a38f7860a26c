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
    """The closed form's per-rank figure of a config's --context-parallel split (a full fine-tune in bf16 with AdamW,
    batch of one sequence); `memfit estimate` itself reads the estimator's (`context_split`)."""
    from memfit.models.presets import resolve_model_config

    hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    shape = shape_from_hf_config(hf_config, 0)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    shape = shape_from_hf_config(hf_config, decoder_parameters(shape, tied))
    distributed = config.distributed
    return per_rank_estimate(shape, config.data.seq_len_or_default, distributed.context_parallel, world_size, levers_of(config),
                             mode=distributed.context_parallel_mode)


# ---------------------------------------------------------------------------
# The estimator's share: one rank of the split as the estimator prices it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextSplit:
    """A --context-parallel run as one rank sees it: the whole sequence, the ranks and this rank's tokens."""

    size: int
    """Ranks one sequence is split over (N)."""
    seq_len: int
    """Whole sequence length (tokens per sample)."""
    world_size: int
    """Ranks in all (data-parallel x N)."""

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of each row one rank holds outside attention: the row padded to a multiple of N, over N."""
        return -(-self.seq_len // self.size)

    @property
    def data_parallel(self) -> int:
        """Context groups (world size / N)."""
        return self.world_size // self.size


def context_split(config, world_size: int):
    """(the config one rank's step is estimated as, the world size, the split) for a --context-parallel run; the
    config itself, the world size and None for any other.

    Outside attention a rank holds seq/N tokens of every row; inside it, the whole row on heads/N, which is as many
    q, k, v and output elements as seq/N tokens on every head: so the step is the whole model's step at seq/N
    tokens (`all_to_all_buffer_bytes` adds what the exchange itself holds). A world size of 1 is read as one
    context group (N ranks); another must divide by N.
    """
    size = config.distributed.context_parallel
    if size <= 1:
        return config, world_size, None
    if world_size == 1:
        world_size = size
    if world_size % size:
        raise UsageError(f"--context-parallel {size} must divide --world-size {world_size}: pick a divisor")
    split = ContextSplit(size, config.data.seq_len, world_size)
    return config.replace(seq_len=split.tokens_per_rank), world_size, split


def all_to_all_buffer_bytes(split: ContextSplit, hf_config, attention_bytes: int, batch: int, layers_kept: int) -> float:
    """What Ulysses' exchange holds on top of the step at seq/N tokens, in bytes.

    Each all-to-all copies its input into N send pieces and receives N pieces before joining them:
    two more tensors of the exchanged one's size, live while one of q, k, v or the output (or their
    gradients) crosses. Key-value heads that do not divide by N are repeated per query head before
    the exchange: K and V are then kept at the query heads' width by every layer that saves them
    (`layers_kept`: every layer without checkpointing, the recomputed one with it).
    """
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    tokens = batch * split.tokens_per_rank
    q_width = heads * head_dim
    exchange = 2 * tokens * q_width * attention_bytes
    repeated = kv_heads % split.size != 0 and kv_heads != heads
    widened = 2 * tokens * (heads - kv_heads) * head_dim * attention_bytes * layers_kept if repeated else 0
    return float(exchange + widened)


def split_details(split: ContextSplit, buffers: float) -> dict:
    """What an estimate says of its split (its details' `context_parallel`)."""
    return {"context_parallel": {"size": split.size, "data_parallel": split.data_parallel,
                                 "seq_len": split.seq_len, "tokens_per_rank": split.tokens_per_rank,
                                 "all_to_all_buffer_bytes": int(buffers)}}


def describe_split(details: dict) -> str:
    """One line for people: the split and this rank's tokens."""
    split = details["context_parallel"]
    return (f"context parallelism (Ulysses): {split['data_parallel']} data-parallel x {split['size']} context-parallel,"
            f" {split['tokens_per_rank']} of {split['seq_len']} tokens per rank; every figure above is one rank's"
            f" (all-to-all buffers {split['all_to_all_buffer_bytes'] / GIB:.3f} GiB)")


# ---------------------------------------------------------------------------
# The speed model's share: Ulysses' all-to-all traffic over the named GPU's link
# ---------------------------------------------------------------------------

PEER_LINK_GBPS = {"h100-80gb": NVLINK4_GBPS, "h200": NVLINK4_GBPS, "a100-80gb": 300.0, "a100-40gb": 300.0}
"""GPU-to-GPU bandwidth one way, GB/s, of the presets whose boards join GPUs by NVLink (A100 SXM: NVLink 3, 600 GB/s
both ways, NVIDIA A100 data sheet). Every other preset's GPUs exchange over PCIe (`GpuSpec.host_link_gbps`)."""
CPU_LINK_GBPS = 16.0
"""What the speed model assumes without a GPU preset (the host link's default in speed_model.py)."""


def peer_link(gpu, size: int) -> tuple[str, float]:
    """(name, GB/s one way) of the link a context group of `size` ranks exchanges over on `gpu` (None: CPU)."""
    if size > GPUS_PER_NODE:
        return "InfiniBand NDR", INFINIBAND_NDR_GBPS
    if gpu is None:
        return "host memory (gloo)", CPU_LINK_GBPS
    if gpu.name in PEER_LINK_GBPS:
        return "NVLink", PEER_LINK_GBPS[gpu.name]
    return "PCIe", gpu.host_link_gbps


def ulysses_bytes_per_step(hf_config, seq_len: int, size: int, rows: int, element_bytes: int,
                           recomputed: bool) -> float:
    """Bytes one rank sends per optimizer step over Ulysses' all-to-alls.

    Per layer and pass, q, k, v and the output of this rank's seq/N tokens are exchanged ((N-1)/N of each leaves
    the rank); forward and backward (their gradients) each do it once, and checkpointing's recomputed forward once
    more. K and V move at the key-value width, or at the query width where the key-value heads do not divide by N
    (repeated per query head first). `rows`: sequences per optimizer step on this rank (micro-batch x accumulation).
    """
    if size <= 1:
        return 0.0
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_width = (kv_heads if kv_heads % size == 0 else heads) * head_dim
    per_pass = (2 * heads * head_dim + 2 * kv_width) * -(-seq_len // size) * element_bytes * (size - 1) / size
    passes = 3 if recomputed else 2
    return float(hf_config.num_hidden_layers * passes * per_pass * rows)


def ulysses_seconds(changes: dict, config, hf_config, gpu, compute: str) -> float:
    """Seconds one optimizer step spends in Ulysses' all-to-alls, in full (an upper bound: nothing overlaps them)."""
    size = changes.get("context_parallel", config.distributed.context_parallel)
    if size <= 1:
        return 0.0
    rows = changes.get("batch_size", config.training.batch_size) * changes.get("gradient_accumulation_steps", 1)
    recomputed = changes.get("gradient_checkpointing", config.memory.gradient_checkpointing) == "full"
    moved = ulysses_bytes_per_step(hf_config, changes.get("seq_len", config.data.seq_len_or_default), size, rows,
                                   4 if compute == "fp32" else 2, recomputed)
    return moved / (peer_link(gpu, size)[1] * 1e9)

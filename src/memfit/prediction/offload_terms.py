"""Activation offload's terms: what the first N blocks send to host memory, and the host bytes of a run.

Split from the estimator (prediction/estimator.py), which calls both for the analytical peak.
"""

from __future__ import annotations

from typing import Any

from memfit.config import TrainConfig
from memfit.prediction.activations import ActivationTerms, Precision, activation_bytes
from memfit.prediction.encoders import architecture_for
from memfit.prediction.run_shape import RunShape, precision_of


def host_activations(config: TrainConfig, run: RunShape, hf_config: Any) -> float:
    if not run.activation_offload:
        return 0.0
    arch, precision = architecture_for(hf_config), precision_of(run)
    terms = activation_bytes(
        arch, precision, batch_size=config.training.batch_size,
        seq_len=config.data.seq_len_or_default, attention=run.attention, checkpointing=run.checkpointing,
        checkpoint_every=run.checkpoint_every, mlp_tiles=run.mlp_tiles, offload=run.activation_offload_blocks is None,
        unchunked_loss=not run.fused_loss and not 0 < run.loss_chunk_size < config.training.batch_size * (config.data.seq_len_or_default - 1),
    )
    return offload_first_blocks(terms, run, arch, precision, config.training.batch_size * config.data.seq_len_or_default).host


def offload_first_blocks(terms: ActivationTerms, run: RunShape, arch, precision: Precision,
                          tokens: int) -> ActivationTerms:
    """Partial offload (`run.activation_offload_blocks`): the no-offload terms less what the first N blocks send to host.

    Each offloaded checkpointed block takes its input (one residual-stream tensor) off the device,
    an uncheckpointed one its whole block (both measured with the tracker on CPU). Under LoRA the
    first block's input is the embedding output, a leaf the graph keeps on the device: it is not
    copied. In backward two inputs are on the device in the offloaded blocks (the one in use and
    the one fetched ahead); the kept blocks' inputs cover that unless fewer than two are kept. The
    later blocks and the head keep theirs as without offload: the terms are the no-offload ones
    (the tracker-checked base) less what leaves, not the full-offload ones.
    """
    if run.activation_offload_blocks is None:
        return terms
    blocks = min(run.activation_offload_blocks, arch.layers)
    checkpointed = len(range(0, blocks, max(1, run.checkpoint_every)))
    leaf = 1 if run.lora_r and blocks else 0
    block_input = precision.residual * arch.hidden * tokens
    host = (checkpointed - leaf) * block_input + (blocks - checkpointed) * terms.per_layer
    in_flight = max(0, 2 - (arch.layers - blocks)) * block_input if host else 0.0
    return terms._replace(kept=terms.kept - host + in_flight, host=host)

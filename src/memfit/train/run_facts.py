"""What really runs, as the metrics' start and summary lines (and the memory record) say it."""

from __future__ import annotations

from typing import Any

from memfit.data.samples import dataset_facts
from memfit.resolution.resolve import report as run_report
from memfit.techniques.packed_attention import packing_facts
from memfit.train.setup import TrainingSession


def run_facts(session: TrainingSession) -> dict[str, Any]:
    """What really runs: recorded in the metrics' start and summary lines."""
    from memfit.models.experts import experts_facts
    from memfit.techniques.expert_quant import experts_precision
    from memfit.techniques.expert_streaming import expert_streaming_facts
    from memfit.techniques.lora import lora_facts
    from memfit.techniques.staged_weights import staged_load_facts
    from memfit.techniques.tiled_experts import tiled_experts_facts

    config = session.config
    return {
        "model": config.model.model,
        "device": str(session.device),
        "world_size": session.dist.world_size,
        "precision": session.precision.name,
        "precision_reason": session.precision.reason,
        "optimizer": session.optimizer_name,
        "attention": session.attention.implementation,
        "gradient_checkpointing": session.checkpointing,
        "loss_chunk_size": session.run.loss_chunk_size,
        "loss_head_gradient": session.run.head_gradient or None,  # in place / per chunk (chunked loss)
        "effective_batch_size": session.effective_batch_size,
        "seq_len": config.data.seq_len,
        "kernels": session.applied.get("kernels", "none"),
        "compile": session.compiled,
        "compiled_ran": session.run.compiled,  # what code reads; "compile" is for people
        "techniques": run_report(session.run),  # what each technique of the registry says about this run
        "rope_scaling": session.loaded.rope_scaling.describe() if session.loaded.rope_scaling else None,
        "packing": packing_facts(session.dataset),
        "data": dataset_facts(session.dataset),
        "fallbacks": dict(session.fallbacks),
        # Settings memfit chose from others the user gave (config.derived): in the fallbacks above, but nothing asked
        # for fell back; the report shows them apart.
        "derived_settings": dict(config.derived) or None,
        "task": session.task.facts(),  # what is learned: the console, the summary and the report word its results
        "lora": lora_facts(session.model, config.lora) if config.lora.lora_r > 0 else None,  # what trains
        "experts": experts_facts(session.model),  # MoE: the experts implementation that ran, active parameters
        "experts_weights": experts_precision(session.model),  # MoE: "experts nf4" (QLoRA) or the load dtype
        "tiled_experts": tiled_experts_facts(session.model),  # MoE layers whose experts ran over token tiles
        "expert_offload": expert_streaming_facts(session.model),  # --expert-offload: host bytes, bytes streamed
        "staged_load": staged_load_facts(session.model),  # weights loaded into host memory, moved in final form
    }

"""Profile a run: a few real training steps under the tracker, summarized into a report."""

from __future__ import annotations

import logging

import torch

from memfit.config import TrainConfig
from memfit.memory.report import ProfileReport, ReportContext, build_report
from memfit.train.loop import make_tracker, run_facts, train
from memfit.train.setup import build_session

log = logging.getLogger("memfit")


def profile_run(
    config: TrainConfig, top: int = 10, plot_path: str | None = None, snapshot_path: str | None = None
) -> tuple[ProfileReport, dict]:
    """Train `config.training.max_steps` steps with the tracker on; write nothing but the plot/snapshot.

    Returns the report and extra JSON fields (what ran, the CUDA allocator cross-check).
    """
    session = build_session(config)
    tracker = make_tracker(session, always=True)
    record_history = snapshot_path is not None and session.device.type == "cuda"
    if snapshot_path is not None and not record_history:
        log.warning("memfit: --snapshot needs CUDA (the allocator history); skipped on %s", session.device)
    if record_history:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    result = train(config, session=session, tracker=tracker, save_outputs=False)
    extra: dict = {"run": run_facts(session), "losses": result.losses}
    if session.device.type == "cuda":
        extra["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(session.device)
    if record_history:
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)
        extra["snapshot"] = snapshot_path
    output_embeddings = session.model.get_output_embeddings()
    context = ReportContext(
        gradient_checkpointing=session.run.checkpointing_on,
        optimizer=session.run.optimizer,
        lora=session.run.lora_r > 0,
        loss_chunk_size=session.run.loss_chunk_size,
        vocab_size=output_embeddings.weight.shape[0] if output_embeddings is not None else None,
        optimizer_in_backward=session.run.optimizer_in_backward,
        tiled_mlp=session.run.mlp_tiles,
        activation_offload=session.run.activation_offload,
    )
    report = build_report(result.memory_steps, tracker.peak_snapshot(), str(session.device), context, top)
    extra["timeline"] = tracker.timeline()  # the peak step, for the HTML report
    if plot_path:
        from memfit.memory.plot import plot_timeline

        plot_timeline(tracker.timeline(), plot_path, title=f"memfit profile: {config.model.model}")
        extra["plot"] = plot_path
    return report, extra

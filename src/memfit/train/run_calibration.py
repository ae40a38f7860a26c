"""A finished planned run teaches the speed model what a step costs on this device (memfit.prediction.calibration).

Called by the loop at the end of a run; trials (train/trials.py) feed the same calibration before a run.
"""

from __future__ import annotations

import logging
from typing import Any

from memfit.prediction import calibration

log = logging.getLogger("memfit")


def learn_from_run(session: Any, summary: dict[str, Any], first_step_seconds: float | None) -> None:
    """A finished planned run on this CPU calibrates the speed model with its median step (and, compiled,
    its first step's compile time). Never stops a run: a failure here is logged and forgotten."""
    config = session.config
    if (session.device.type != "cpu" or session.dist.world_size > 1 or config.memory.memory_budget is None
            or (summary.get("steps") or 0) < 4 or not summary.get("measured_step_seconds")):
        return
    try:
        from memfit.prediction.estimator import estimate
        from memfit.prediction.speed_model import compute_dtype, estimated_step_seconds

        model = session.model.get_base_model() if hasattr(session.model, "get_base_model") else session.model
        hf_config = model.config
        run = session.run  # what ran: an eager fallback of --compile calibrates as eager (run.compiled is cleared)
        changes = {"batch_size": config.training.batch_size, "gradient_accumulation_steps": session.accumulation_steps,
                   "gradient_checkpointing": run.checkpointing if run.checkpointing_on else "off",
                   "loss_chunk_size": run.loss_chunk_size, "compile": run.compiled}
        model_seconds = estimated_step_seconds(changes, config, estimate(config, hf_config=hf_config), None,
                                               hf_config, device="cpu", calibrate=False)
        measured = summary["measured_step_seconds"]
        compute = compute_dtype(changes, config, "cpu")
        calibration.record_points("cpu", [(calibration.features(changes, config, compute), model_seconds, measured)],
                                  "run")
        if changes["compile"] and first_step_seconds and first_step_seconds > measured:
            calibration.record_compile("cpu", first_step_seconds - measured, None)
    except Exception as error:  # calibration is a help, never a reason to fail a finished run
        log.info("memfit: speed calibration skipped: %s: %s", type(error).__name__, str(error)[:120])


"""The tracked peak of a short `memfit profile` run beside the analytical estimate of the same config."""

from __future__ import annotations

from typing import Any


def peaks_and_estimates(configs: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, int]]:
    """For each named config: the steady step's tracked device peak and the estimate's peak, in bytes."""
    from memfit.prediction.estimator import estimate
    from memfit.train.profiling import profile_run

    peaks, estimates = {}, {}
    for key, config in configs.items():
        estimates[key] = estimate(config).peak_bytes
        report, _ = profile_run(config)
        peaks[key] = report.to_dict()["peak_bytes"]
    return peaks, estimates

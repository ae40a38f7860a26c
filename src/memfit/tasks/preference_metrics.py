"""A preference task's metrics under TRL's names, gathered per micro-batch on the device and read once a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

METRIC_ORDER = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl")
"""TRL's metric names, in the order a metrics line lists them."""

# -- the metrics ------------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    pairs: torch.Tensor
    """The micro-batch's pair indices (on the device: read only when the metrics are)."""
    names: tuple[str, ...]
    values: torch.Tensor
    """One value a name: the micro-batch's mean."""
    weights: torch.Tensor
    """What each value averaged over (pairs, or for KTO's per-side metrics the examples of that side)."""


class PreferenceMetrics:
    """TRL-named metrics of the micro-batches since the last `result()`, kept on the device until then.

    Each micro-batch's means are weighted by what they average over, so the result is the mean over the pairs of
    every micro-batch, however the batch was split. A micro-batch whose pairs a later one redoes (an OOM in its
    backward, after its forward recorded them) counts only in its redo. The evaluation's metric stream too.
    """

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def add(self, pairs: torch.Tensor, metrics: dict[str, torch.Tensor], weights: dict[str, torch.Tensor | float]
            ) -> None:
        names = tuple(name for name in metrics if name != "rewards/margins")  # recomputed from the sides' means
        device = pairs.device
        values = torch.stack([metrics[name].detach().float().to(device) for name in names])
        counts = torch.stack([torch.as_tensor(weights[name], dtype=torch.float32, device=device) for name in names])
        self._entries.append(_Entry(pairs.detach(), names, values, counts))

    def clear(self) -> None:
        self._entries = []

    def result(self) -> dict[str, float]:
        """The weighted means by name, in TRL's order (one read from the device); then empty."""
        entries, self._entries = self._entries, []
        if not entries:
            return {}
        flat = torch.cat([torch.cat([entry.pairs.float(), entry.values, entry.weights]) for entry in entries]).tolist()
        sums: dict[str, float] = {}
        totals: dict[str, float] = {}
        seen: set[int] = set()
        offset = len(flat)
        for entry in reversed(entries):  # the last run of a pair is the one whose gradient counted
            size = entry.pairs.numel() + 2 * len(entry.names)
            offset -= size
            part = flat[offset : offset + size]
            pairs = {int(value) for value in part[: entry.pairs.numel()]}
            if pairs & seen:
                continue
            seen |= pairs
            values = part[entry.pairs.numel() : entry.pairs.numel() + len(entry.names)]
            weights = part[entry.pairs.numel() + len(entry.names) :]
            for name, value, weight in zip(entry.names, values, weights, strict=True):
                if weight > 0:
                    sums[name] = sums.get(name, 0.0) + value * weight
                    totals[name] = totals.get(name, 0.0) + weight
        means = {name: sums[name] / totals[name] for name in sums}
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return {name: means[name] for name in METRIC_ORDER if name in means} | {
            name: value for name, value in means.items() if name not in METRIC_ORDER}

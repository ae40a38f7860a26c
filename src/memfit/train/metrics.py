"""Metric loggers: JSON lines on disk by default, a no-op logger, optional TensorBoard.

Each optimizer step writes one JSON object per line; events (an OOM recovered, a
fallback) and the final summary are lines too, with an "event" field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol


class MetricLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # a 0-d tensor or numpy scalar (torchao keeps the learning rate as a tensor)
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


class JsonlLogger:
    """Appends one JSON object per line and flushes, so a killed run keeps what it logged."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._handle.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class NullLogger:
    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Writes the numeric fields of step records as scalars (needs the tensorboard package)."""

    def __init__(self, directory: str | Path):
        from memfit.errors import UsageError

        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self._writer = SummaryWriter(str(directory))

    def log(self, record: dict[str, Any]) -> None:
        if "step" not in record or "event" in record:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()


class MultiLogger:
    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (what tests and reports read)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

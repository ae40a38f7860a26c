"""Metric loggers: JSON lines on disk by default, a no-op logger, optional experiment trackers.

Each optimizer step writes one JSON object per line; events (an OOM recovered, a
fallback) and the final summary are lines too, with an "event" field.

`--report-to tensorboard,wandb,mlflow` (`--tensorboard` is the same as naming
tensorboard) sends the same numbers to the trackers people already use, each optional
and each kept inside the output directory, with no network: TensorBoard event files in
`tensorboard/`, a Weights & Biases run in offline mode under `wandb/` (upload it later
with `wandb sync`), an MLflow file store in `mlruns/` (`mlflow ui --backend-store-uri
file://...`). Every tracker gets the configuration once, then per step the numeric
fields of the step line (nested byte breakdowns flattened to `tracked_breakdown/activations`),
a `events/<kind>` count at the step of each event, and the numeric summary at the end.
`check_trackers` refuses a missing package before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from memfit.errors import UsageError

if TYPE_CHECKING:
    from memfit.config import OutputConfig, TrainConfig


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


# tracker name -> (module that must be importable, pip package)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def requested_trackers(output: OutputConfig) -> list[str]:
    """The trackers named by --report-to (and --tensorboard), in order, each once.

    "none" names no tracker and "all" every one, as in the Hugging Face Trainer.
    Raises UsageError for a name memfit does not know.
    """
    from memfit.config_loading import suggest

    names = [name.strip().lower() for name in (output.report_to or "").split(",") if name.strip()]
    if "all" in names:
        names = list(TRACKERS)
    names = [name for name in names if name != "none"]
    if output.tensorboard:
        names.append("tensorboard")
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        choices = ", ".join(TRACKERS)
        raise UsageError(
            f"--report-to {unknown[0]}: unknown tracker{suggest(unknown[0], TRACKERS)}; choose from {choices} (or none)"
        )
    return list(dict.fromkeys(names))


def check_trackers(output: OutputConfig) -> list[str]:
    """The requested trackers; a UsageError naming the package to install when one is missing."""
    names = requested_trackers(output)
    for name in names:
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            flag = "--tensorboard" if name == "tensorboard" and output.tensorboard else f"--report-to {name}"
            raise UsageError(f"{flag} needs the {module} package: pip install {package} (or drop {flag})")
    return names


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step line, nested dicts of numbers flattened as `outer/inner` (what every tracker logs)."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        value = _clean(value)
        if key == "step":
            continue
        if isinstance(value, dict):
            for inner, number in value.items():
                number = _clean(number)
                if _is_number(number):
                    scalars[f"{key}/{inner}"] = float(number)
        elif _is_number(value):
            scalars[key] = float(value)
    return scalars


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def flat_config(config: TrainConfig | dict[str, Any] | None) -> dict[str, Any]:
    """The configuration as flat name -> value (None for unset), what trackers store as parameters."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    return config.flat()


class TrackerLogger:
    """Routes metric records to one tracker: the configuration first, then steps, events and the summary.

    Subclasses implement `_config`, `_scalars` and `_finish`; the record routing, the
    event counts and the flattening are shared, so every tracker logs the same numbers.
    """

    def __init__(self, config: dict[str, Any]):
        self._config_logged = False
        self._pending_config = config

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        if kind == "start":
            facts = {f"ran/{key}": value for key, value in record.items() if key != "event"}
            self._config({**self._pending_config, **facts})
        elif kind == "summary":
            self._scalars(record.get("steps") or 0, {f"summary/{key}": value for key, value in step_scalars(record).items()})
        elif kind == "eval" and isinstance(record.get("step"), int):  # eval_loss -> eval/loss, at its step
            self._scalars(record["step"], {f"eval/{key.removeprefix('eval_')}": value for key, value in step_scalars(record).items()})
        elif kind is not None:
            if isinstance(record.get("step"), int):
                self._scalars(record["step"], {f"events/{kind}": 1.0})
        elif isinstance(record.get("step"), int):
            self._scalars(record["step"], step_scalars(record))

    def close(self) -> None:
        self._finish()

    def _config(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class TensorBoardLogger(TrackerLogger):
    """TensorBoard event files in `directory` (needs the tensorboard package)."""

    def __init__(self, directory: str | Path, config: dict[str, Any] | None = None):
        super().__init__(config or {})
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
        self._writer = SummaryWriter(str(directory))

    def _config(self, values: dict[str, Any]) -> None:
        table = "\n".join(f"| {key} | {value} |" for key, value in values.items())
        self._writer.add_text("config", "| setting | value |\n|---|---|\n" + table, 0)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def _finish(self) -> None:
        self._writer.close()


class WandbLogger(TrackerLogger):
    """A Weights & Biases run in offline mode, written under `directory`/wandb (upload it later with `wandb sync`).

    wandb's service finishes writing the run file in the background; it is complete when the
    process exits (or after `wandb.teardown()` for a library user who reads it in the same process).
    """

    def __init__(self, directory: str | Path, config: dict[str, Any] | None = None, name: str | None = None):
        super().__init__(config or {})
        import wandb

        os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the environment says
        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode="offline", console="off", silent=True, x_disable_stats=True)
        self._run = wandb.init(
            project="memfit", dir=str(directory), name=name, config=dict(self._pending_config), settings=settings,
            reinit="create_new",
        )

    def _config(self, values: dict[str, Any]) -> None:
        self._run.config.update(values, allow_val_change=True)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def _finish(self) -> None:
        self._run.finish()


class MlflowLogger(TrackerLogger):
    """An MLflow run in a local file store, `directory`/mlruns (view it with `mlflow ui --backend-store-uri URI`)."""

    def __init__(self, directory: str | Path, config: dict[str, Any] | None = None, name: str | None = None):
        super().__init__(config or {})
        from mlflow.tracking import MlflowClient

        # Recent MLflow releases keep the file store in maintenance mode and refuse it unless asked: a local
        # store inside the output directory is the point here (no server, no database).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        store = Path(directory).resolve()
        store.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = store.as_uri()
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name("memfit")
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment("memfit")
        self._run_id = self._client.create_run(experiment_id, run_name=name).info.run_id

    def _config(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow keeps a parameter once and caps its length; the configuration is logged once per run.
        params = [Param(key.replace("/", "."), str(value)[:6000]) for key, value in values.items()]
        for start in range(0, len(params), 100):
            self._client.log_batch(self._run_id, params=params[start : start + 100])

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for start in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[start : start + 1000])

    def _finish(self) -> None:
        self._client.set_terminated(self._run_id)


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


def build_loggers(config: TrainConfig, output_dir: str | Path) -> MultiLogger:
    """The run's loggers: metrics.jsonl (or --log-file) and each tracker of --report-to, all under `output_dir`."""
    output_dir = Path(output_dir)
    path = Path(config.output.log_file) if config.output.log_file else output_dir / "metrics.jsonl"
    loggers: list[MetricLogger] = [JsonlLogger(path)]
    settings = flat_config(config)
    name = output_dir.resolve().name
    for tracker in check_trackers(config.output):
        if tracker == "tensorboard":
            loggers.append(TensorBoardLogger(output_dir / "tensorboard", settings))
        elif tracker == "wandb":
            loggers.append(WandbLogger(output_dir, settings, name))
        elif tracker == "mlflow":
            loggers.append(MlflowLogger(output_dir / "mlruns", settings, name))
    return MultiLogger(loggers)

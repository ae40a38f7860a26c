"""What a report shows, read from a run directory (or handed over by `memfit profile`).

A run directory holds `metrics.jsonl` (a "start" line per launch, one line per optimizer
step, event lines such as {"event": "oom"}, a "summary" line per launch), checkpoints
whose `trainer_state.json` keeps the configuration, and, when the tracker ran,
`memory_timeline.json` (see `memory_record`). `load_run` turns these into a `RunData`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

METRICS_FILE = "metrics.jsonl"
MEMORY_RECORD_FILE = "memory_timeline.json"


@dataclass
class RunData:
    """One run as the report sees it.

    Attributes:
        name: the label of the run (its directory's name).
        source: where it was read from.
        facts: what really ran (the start or summary line: precision, optimizer, kernels, fallbacks).
        steps: one record per optimizer step, ordered by step; after a resume the steps
            that were run again keep the values of the later launch (what the final model went through).
        events: event lines tied to a step (OOM recoveries, ...), in order.
        resumes: {"step": first step of the resumed launch minus one, "from": checkpoint}.
        summary: the last summary line, or None when the run has not finished.
        config: the flat configuration saved with the last checkpoint, or None.
        memory: the memory record of the tracker (see `memory_record`), or None.
        kind: "train" or "profile".
    """

    name: str
    source: str
    facts: dict[str, Any]
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    kind: str = "train"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of one numeric step field, skipping steps where it is missing."""
        xs, ys = [], []
        for record in self.steps:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(record["step"])
                ys.append(float(value))
        return xs, ys

    @property
    def task(self) -> dict[str, Any]:
        """What the run learned: the task facts of its metrics (memfit.tasks.Task.facts), or for a run made before
        they were recorded the task named in its saved configuration; {} when neither says (a causal LM)."""
        found = self.facts.get("task")
        if isinstance(found, dict):
            return found
        name = (self.config or {}).get("task")
        return {"name": name} if isinstance(name, str) else {}

    @property
    def sampled_steps(self) -> set[int]:
        """Steps the default ran under the memory tracker alone (train/memory_sample.py): a few times slower than
        the others, so left out of the typical speed. Empty when every step or none was tracked."""
        tracked = {record["step"] for record in self.steps if "tracked_peak_bytes" in record}
        return tracked if len(tracked) < len(self.steps) else set()

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """The eval lines ({"event": "eval", "step", "eval_loss", ...}) by step; after a resume the later one of a step."""
        by_step = {e["step"]: e for e in self.events if e.get("event") == "eval" and isinstance(e.get("step"), int)}
        return [by_step[step] for step in sorted(by_step)]

    @property
    def oom_events(self) -> list[dict[str, Any]]:
        return [event for event in self.events if event.get("event") == "oom"]

    @property
    def final_loss(self) -> float | None:
        _, losses = self.series("loss")
        return losses[-1] if losses else None

    @property
    def first_loss(self) -> float | None:
        _, losses = self.series("loss")
        return losses[0] if losses else None

    def typical_tokens_per_second(self) -> float | None:
        """The median over steps, leaving out the first one (it pays for warm-up) when there are more, and the step
        the default tracked alone (`sampled_steps`) when there are others."""
        steps, values = self.series("tokens_per_second")
        values = values[1:] if len(values) > 1 else values
        steps = steps[1:] if len(steps) > 1 else steps
        sampled = self.sampled_steps
        untracked = [value for step, value in zip(steps, values, strict=True) if step not in sampled]
        values = untracked or values
        return statistics.median(values) if values else None

    def typical_mfu(self) -> float | None:
        """The median model FLOPs utilization over steps, when the metrics carry it."""
        _, values = self.series("mfu")
        values = values[1:] if len(values) > 1 else values
        return statistics.median(values) if values else None

    def peak(self, key: str) -> int | None:
        """The largest value of a byte field over the steps (or from the summary)."""
        _, values = self.series(key)
        candidates = [int(value) for value in values]
        if self.summary and isinstance(self.summary.get(key), (int, float)):
            candidates.append(int(self.summary[key]))
        return max(candidates) if candidates else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line cut short by a killed run is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def metrics_path(run: str | Path) -> Path:
    """The metrics file of a run directory (or the file itself when a .jsonl path is given)."""
    path = Path(run)
    if path.is_file():
        return path
    candidate = path / METRICS_FILE
    if not path.exists():
        raise UsageError(f"{path} does not exist: give the --output-dir of a memfit train run")
    if not candidate.is_file():
        raise UsageError(f"{path} has no {METRICS_FILE}: give the --output-dir of a memfit train run")
    return candidate


def load_run(run: str | Path, name: str | None = None, metrics_file: str | Path | None = None) -> RunData:
    """Read a run directory (or its metrics file) into a `RunData`.

    `metrics_file`: where the metrics are when --log-file put them outside the directory.

    Raises:
        UsageError: the directory does not exist, has no metrics file, or the file holds no record.
    """
    if metrics_file is not None:
        path, directory = Path(metrics_file), Path(run)
        if not path.is_file():
            raise UsageError(f"{path} does not exist: the run wrote no metrics")
    else:
        path = metrics_path(run)
        directory = path.parent
    records = read_jsonl(path)
    if not records:
        raise UsageError(f"{path} holds no metrics: the run stopped before its first step")
    return from_records(records, name or directory.name or str(directory), str(directory), directory)


def from_records(records: list[dict[str, Any]], name: str, source: str, directory: Path | None = None) -> RunData:
    """Build a `RunData` from metric records (what `load_run` does once the file is read)."""
    starts: list[dict[str, Any]] = []
    by_step: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    resumes: list[dict[str, Any]] = []
    summary = None
    pending_resume = None
    for record in records:
        kind = record.get("event")
        if kind == "start":
            starts.append(record)
            pending_resume = record.get("resumed_from") or None
        elif kind == "summary":
            summary = record
        elif kind is not None:
            events.append(record)
        elif isinstance(record.get("step"), int):
            if pending_resume is not None:
                resumes.append({"step": record["step"] - 1, "from": pending_resume})
                pending_resume = None
            by_step[record["step"]] = record
    steps = [by_step[step] for step in sorted(by_step)]
    facts = dict(summary or (starts[-1] if starts else {}))
    for key in ("event", "steps", "final_loss", "first_loss"):
        facts.pop(key, None)
    if not facts.get("fallbacks") and starts:
        facts["fallbacks"] = starts[-1].get("fallbacks") or {}
    data = RunData(name=name, source=source, facts=facts, steps=steps, events=events, resumes=resumes, summary=summary)
    if directory is not None:
        data.config = _saved_config(directory)
        data.memory = _memory_record(directory)
    return data


def _saved_config(directory: Path) -> dict[str, Any] | None:
    """The configuration kept by the newest checkpoint, flattened to flag names."""
    checkpoints = directory / "checkpoints"
    if not checkpoints.is_dir():
        return None
    states = sorted(
        checkpoints.glob("step-*/trainer_state.json"),
        key=lambda state: (
            int(state.parent.name.split("-", 1)[1]) if state.parent.name.split("-", 1)[1].isdigit() else -1
        ),
    )
    for state in reversed(states):
        try:
            config = json.loads(state.read_text(encoding="utf-8")).get("config")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(config, dict):
            flat: dict[str, Any] = {}
            for value in config.values():
                if isinstance(value, dict):
                    flat.update(value)
            return flat or None
    return None


def _memory_record(directory: Path) -> dict[str, Any] | None:
    path = directory / MEMORY_RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None

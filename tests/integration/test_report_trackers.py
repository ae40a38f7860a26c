"""--report-to tensorboard,wandb,mlflow: each tracker gets the same per-step numbers and the configuration,
inside the output directory, without network; a missing package is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.config_loading import load_config
from memfit.train.metrics import build_loggers, step_scalars

RECORDS = [
    {"event": "start", "model": "tiny", "precision": "fp32", "fallbacks": {}},
    {"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 3.0, "precision": "fp32",
     "tracked_breakdown": {"parameters": 100, "activations": 700}},
    {"step": 2, "event": "oom", "phase": "forward", "old_micro_batch_size": 8, "new_micro_batch_size": 4},
    {"step": 2, "loss": 4.25, "lr": 5e-4, "grad_norm": 2.0, "precision": "fp32",
     "tracked_breakdown": {"parameters": 100, "activations": 350}},
    {"event": "summary", "steps": 2, "final_loss": 4.25, "oom_events": 1},
]
STEP_KEYS = {"loss", "lr", "grad_norm", "tracked_breakdown/parameters", "tracked_breakdown/activations"}


def _log_all(tracker: str, out: Path) -> None:
    config = load_config(overrides={"model": "tiny", "report_to": tracker, "output_dir": str(out), "lr": 0.00123})
    logger = build_loggers(config, out)
    for record in RECORDS:
        logger.log(record)
    logger.close()


def _tensorboard_history(out: Path) -> tuple[dict[str, dict[int, float]], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    history = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    config_text = " ".join(
        str(tensor.tensor_proto.string_val) for tag in events.Tags()["tensors"] for tensor in events.Tensors(tag)
    )
    return history, config_text


def _mlflow_history(out: Path) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("memfit")
    (run,) = client.search_runs([experiment.experiment_id])
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
    return history, run.data.params


def _wandb_records(path: Path):
    """The protobuf records of an offline .wandb file (a LevelDB-style log of 32 KiB blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, pending = path.read_bytes(), 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + payload)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += payload


def _wandb_history(out: Path) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    import wandb

    wandb.teardown()  # the wandb service writes the run file in the background: wait until it is done
    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[str, dict[int, float]] = {}
    config: dict[str, str] = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("_step", None)
            for key, value in items.items():
                if not key.startswith("_") and isinstance(value, (int, float)):
                    history.setdefault(key, {})[step] = float(value)
        elif kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
    return history, config


READERS = {"tensorboard": _tensorboard_history, "mlflow": _mlflow_history, "wandb": _wandb_history}
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


@pytest.mark.parametrize("tracker", list(READERS))
def test_tracker_gets_the_step_metrics_events_and_config(tracker, tmp_path):
    pytest.importorskip(PACKAGES[tracker])
    _log_all(tracker, tmp_path)
    history, config = READERS[tracker](tmp_path)
    expected = {}
    for record in RECORDS:
        if "event" not in record:
            for key, value in step_scalars(record).items():
                expected.setdefault(key, {})[record["step"]] = value
    assert STEP_KEYS == set(expected)
    for key, values in expected.items():
        assert history[key] == pytest.approx(values), key
    assert history["events/oom"] == {2: 1.0}
    assert history["summary/final_loss"] == {2: 4.25}
    assert "0.00123" in str(config)  # the configuration, once
    assert (tmp_path / "metrics.jsonl").is_file()  # the JSON lines are still written


@pytest.mark.parametrize(
    "flags, hidden, expected",
    [
        (["--report-to", "wandb"], "wandb", "--report-to wandb needs the wandb package: pip install wandb"),
        (["--report-to", "tensorboard,mlflow"], "mlflow", "--report-to mlflow needs the mlflow package: pip install mlflow-skinny"),
        (["--tensorboard"], "tensorboard", "--tensorboard needs the tensorboard package: pip install tensorboard"),
        (["--report-to", "wandbb"], None, "--report-to wandbb: unknown tracker (did you mean wandb?)"),
    ],
)
def test_missing_tracker_is_one_line_exit_2_nothing_written(flags, hidden, expected, llama_dir, tmp_path,
                                                            warm_memfit):
    out = tmp_path / "out"
    args = ["train", "--model", str(llama_dir), "--max-steps", "1", "--output-dir", str(out), *flags]
    # forked from the warm server with the tracker's package hidden in the child (its sys.modules entry None)
    result = warm_memfit.run(*args, hidden=(hidden,) if hidden else ())
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_train_reports_to_every_tracker_offline(llama_dir, text_file, tmp_path, warm_memfit):
    names = [name for name in READERS if _installed(PACKAGES[name])]
    if not names:
        pytest.skip("no tracker package installed")
    out = tmp_path / "run"
    # forked from the session's warm server (tests/memfit_cli.py): the real command without importing torch again
    result = warm_memfit.run(
        "train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "64", "--batch-size", "4", "--max-steps", "3",
        "--report-to", ",".join(names), "--output-dir", out, "--no-report",
    )
    assert result.returncode == 0, result.stderr
    for name in names:
        history, _ = READERS[name](out)
        assert sorted(history["loss"]) == [1, 2, 3], name


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None

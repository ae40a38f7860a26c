"""Evaluation: the token-weighted eval loss of a run, its batches, its peak, its own OOM recovery, --save-best.

The runs train with SGD without clipping on a tiny saved Llama; samples are whole documents
(--packing off), so their lengths differ and a mean of batch means would not be the eval loss.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.data import IGNORE_INDEX, collate
from memfit.errors import UsageError
from memfit.techniques.loss import causal_lm_loss_sum
from memfit.techniques.precision import resolve_precision
from memfit.train.evaluation import Evaluator, held_out_indices
from memfit.train.loop import train
from memfit.train.metrics import TrackerLogger, read_metrics
from memfit.train.setup import build_session


def _config(llama_dir, text_file, out, **extra):
    values = dict(
        model=str(llama_dir), dataset=str(text_file), seq_len=64, packing="off", batch_size=4, max_steps=3,
        loss_chunk_size=0, output_dir=str(out), lr=1.0, eval_fraction=0.02, **SGD_NO_CLIPPING,
    )
    return load_config(overrides=values | extra)


def _eval_lines(out) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "eval"]


def _steps(out) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]


def _eval_samples(config) -> list[dict]:
    """The eval set of `config`, as a fresh session builds it (the split depends on the config only)."""
    session = build_session(config)
    return [session.eval_dataset[i] for i in range(len(session.eval_dataset))]


def _reference_loss(model_dir, samples) -> float:
    """One sample at a time, cross-entropy written out here: the sum over target tokens / their count."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=sample["input_ids"][None]).logits[0, :-1].double()
            targets = sample["labels"][1:]
            total += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int((targets != IGNORE_INDEX).sum())
    return total / count


@pytest.fixture(scope="module")
def run(llama_dir, text_file, tmp_path_factory):
    """Three steps, an eval after each, the tracker on, the best model kept."""
    out = tmp_path_factory.mktemp("eval-run")
    config = _config(llama_dir, text_file, out, eval_every=1, save_best=True, track_memory=True)
    result = train(config)
    return {"config": config, "out": out, "result": result, "samples": _eval_samples(config)}


def test_eval_loss_equals_a_separate_forward_pass(run):
    evals = _eval_lines(run["out"])
    assert [e["step"] for e in evals] == [1, 2, 3]
    last = evals[-1]
    expected = _reference_loss(run["result"].final_dir, run["samples"])
    assert last["eval_loss"] == pytest.approx(expected, abs=1e-6)
    assert last["eval_perplexity"] == pytest.approx(np.exp(expected), rel=1e-6)
    assert last["eval_samples"] == len(run["samples"])
    assert last["eval_tokens"] == sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in run["samples"])
    summary = [r for r in read_metrics(run["out"] / "metrics.jsonl") if r.get("event") == "summary"][-1]
    assert summary["eval_loss"] == last["eval_loss"] and summary["eval_step"] == 3
    # The run trained: an eval loss that ignored the weights would not move.
    assert len({round(e["eval_loss"], 6) for e in evals}) == 3


def test_save_best_keeps_the_model_of_the_lowest_eval_loss(run):
    evals = _eval_lines(run["out"])
    best = json.loads((run["out"] / "best.json").read_text())
    lowest = min(evals, key=lambda e: e["eval_loss"])
    assert best["step"] == lowest["step"] and best["eval_loss"] == lowest["eval_loss"]
    # best/ holds the weights of that step: they give exactly its eval loss.
    assert _reference_loss(run["out"] / "best", run["samples"]) == pytest.approx(lowest["eval_loss"], abs=1e-6)
    summary = [r for r in read_metrics(run["out"] / "metrics.jsonl") if r.get("event") == "summary"][-1]
    assert summary["best_eval_step"] == lowest["step"]


def test_eval_peak_is_at_most_the_training_steps(run):
    for step in _steps(run["out"]):
        phases = step["tracked_phase_peaks"]
        assert phases["eval"] > 0
        assert phases["eval"] <= max(phases["forward"], phases["backward"], phases["optimizer"])


def _evaluator(model, samples, batch_size, pad_token_id=256):
    return Evaluator(
        model=model, samples=samples, device=torch.device("cpu"), precision=resolve_precision("fp32", torch.device("cpu")),
        collate=lambda pieces: collate(pieces, pad_token_id), loss_fn=causal_lm_loss_sum, loss_chunk_size=0,
        batch_size=batch_size,
    )


def test_eval_loss_does_not_depend_on_the_eval_batch(run):
    model = AutoModelForCausalLM.from_pretrained(run["result"].final_dir, dtype=torch.float32).train()
    samples = run["samples"]
    losses = {size: _evaluator(model, samples, size).evaluate().loss for size in (1, 3, len(samples))}
    assert losses[3] == pytest.approx(losses[1], abs=1e-6)
    assert losses[len(samples)] == pytest.approx(losses[1], abs=1e-6)
    # The check has power: a mean of batch means (what a per-batch average gives) differs on these samples.
    means = [_evaluator(model, samples[i : i + 3], 3).evaluate().loss for i in range(0, len(samples), 3)]
    assert abs(float(np.mean(means)) - losses[1]) > 1e-4
    assert model.training  # evaluate() restores the mode it found


@contextlib.contextmanager
def _oom_in_eval_batches_above(size: int):
    """An out-of-memory error in any forward without gradients (evaluation) over more than `size` samples.

    Raised from the token embedding (found by its type, not memfit's internals), whose input is the batch.
    """
    raised = {"n": 0}

    def hook(module, args):
        if isinstance(module, torch.nn.Embedding) and not torch.is_grad_enabled() and args[0].shape[0] > size:
            raised["n"] += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield raised
    finally:
        handle.remove()


def test_injected_eval_oom_splits_the_eval_batch_only(run, llama_dir, text_file, tmp_path):
    with _oom_in_eval_batches_above(2) as raised:
        train(_config(llama_dir, text_file, tmp_path, eval_every=1, max_steps=2))
    assert raised["n"] >= 1
    ooms = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "oom"]
    assert ooms and {e["phase"] for e in ooms} == {"eval"}
    assert ooms[0]["old_eval_batch_size"] == 4 and ooms[-1]["new_eval_batch_size"] == 2
    evals = _eval_lines(tmp_path)
    assert [e["eval_batch_size"] for e in evals] == [2, 2]
    # Training's micro-batch and accumulation never moved, and the numbers are the unsplit run's.
    assert [(s["micro_batch_size"], s["gradient_accumulation_steps"]) for s in _steps(tmp_path)] == [(4, 1), (4, 1)]
    reference = _eval_lines(run["out"])[:2]
    for got, expected in zip(evals, reference, strict=True):
        assert got["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-6)


def test_held_out_split_is_deterministic_and_disjoint():
    train_rows, eval_rows = held_out_indices(1000, 0.05, seed=3)
    again = held_out_indices(1000, 0.05, seed=3)
    assert np.array_equal(train_rows, again[0]) and np.array_equal(eval_rows, again[1])
    assert len(eval_rows) == 50 and not set(train_rows) & set(eval_rows)
    assert sorted(set(train_rows) | set(eval_rows)) == list(range(1000))
    assert not np.array_equal(eval_rows, held_out_indices(1000, 0.05, seed=4)[1])
    assert len(held_out_indices(10, 0.001, seed=0)[1]) == 1  # at least one sample


def test_eval_fraction_run_trains_on_the_rest(llama_dir, text_file, tmp_path):
    session = build_session(_config(llama_dir, text_file, tmp_path))
    train_ids = {tuple(session.dataset[i]["input_ids"].tolist()) for i in range(len(session.dataset))}
    eval_ids = {tuple(session.eval_dataset[i]["input_ids"].tolist()) for i in range(len(session.eval_dataset))}
    assert session.schedule.num_samples == len(session.dataset) == len(session.dataset.base) - len(session.eval_dataset)
    assert eval_ids and not (eval_ids & train_ids) - {()}  # documents repeated in the corpus aside, none is shared


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"save_best": True}, "--save-best needs an evaluation set"),
        ({"eval_every": 5}, "--eval-every needs an evaluation set"),
        ({"eval_fraction": 1.5}, "--eval-fraction must be"),
        ({"eval_fraction": 0.1, "eval_dataset": "x.jsonl"}, "not both"),
        ({"eval_batch_size": 0, "eval_fraction": 0.1}, "--eval-batch-size must be at least 1"),
    ],
)
def test_bad_evaluation_settings_are_one_usage_error(settings, message):
    with pytest.raises(UsageError, match=message):
        load_config(overrides=settings)


def test_trainer_names_map_to_evaluation_settings():
    config = load_config(overrides={"eval_steps": "5", "val_set_size": "0.1", "per_device_eval_batch_size": "3",
                                    "load_best_model_at_end": "true", "evaluation_strategy": "steps"})
    evaluation = config.evaluation
    assert (evaluation.eval_every, evaluation.eval_fraction, evaluation.eval_batch_size, evaluation.save_best) == (5, 0.1, 3, True)
    assert load_config(overrides={"eval_strategy": "none"}).evaluation.eval_strategy == "no"


def test_trackers_get_the_eval_loss_at_its_step():
    seen = []

    class Recorder(TrackerLogger):
        def _config(self, values):
            pass

        def _scalars(self, step, values):
            seen.append((step, values))

        def _finish(self):
            pass

    Recorder({}).log({"event": "eval", "step": 7, "eval_loss": 2.5, "eval_perplexity": 12.18, "eval_tokens": 90})
    assert seen == [(7, {"eval/loss": 2.5, "eval/perplexity": 12.18, "eval/tokens": 90.0})]


class _Samples(torch.utils.data.Dataset):
    """Whole samples with the `lengths` array packing reads."""

    def __init__(self, samples):
        self.items = samples
        self.lengths = np.asarray([len(s["input_ids"]) for s in samples])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def _training_collate(pieces):
    """The step's own collate: the mask of packed rows dropped, so position_ids say where each sample is."""
    from memfit.data.prefetch import BatchPrefetcher

    return BatchPrefetcher(lambda s: collate(s, 256), torch.device("cpu"), drop_full_attention_mask=True).collate(pieces)


def test_eval_over_packed_rows_equals_the_samples_one_by_one(run):
    from memfit.data.packing import PackedDataset

    model = AutoModelForCausalLM.from_pretrained(run["result"].final_dir, dtype=torch.float32, attn_implementation="sdpa")
    samples = run["samples"]
    packed = PackedDataset(_Samples(samples), seq_len=256)
    assert len(packed) < len(samples)  # several samples share a row
    one_by_one = _evaluator(model, samples, 1).evaluate()
    evaluator = _evaluator(model, packed, 2)
    evaluator.collate = _training_collate
    result = evaluator.evaluate()
    assert result.samples == len(samples) and result.target_tokens == one_by_one.target_tokens
    assert result.loss == pytest.approx(one_by_one.loss, abs=1e-5)
    # The twin: rows without their positions let each sample attend to the one before it.
    evaluator.collate = lambda pieces: {k: v for k, v in collate(pieces, 256).items() if k != "position_ids"}
    assert abs(evaluator.evaluate().loss - one_by_one.loss) > 1e-4


def test_eval_dataset_of_conversations(llama_dir, tmp_path):
    conversations = tmp_path / "eval.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {n} plus {n}?"},
                          {"role": "assistant", "content": f"{n} plus {n} is {2 * n}."}]} for n in range(6)]
    conversations.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    config = load_config(overrides=dict(
        model=str(llama_dir), dataset="builtin:chat", chat_template="chatml", eval_dataset=str(conversations),
        seq_len=256, allow_drop=True, batch_size=4, max_steps=1, loss_chunk_size=0, output_dir=str(tmp_path / "out"), **SGD_NO_CLIPPING,
    ))
    result = train(config)
    (last,) = _eval_lines(tmp_path / "out")
    assert last["eval_samples"] == 6
    session = build_session(config.replace(output_dir=str(tmp_path / "again")))
    samples = [session.eval_dataset.samples[i] for i in range(6)]  # the conversations, before packing
    # Only the answers carry loss: fewer target tokens than tokens.
    assert last["eval_tokens"] < sum(len(s["input_ids"]) for s in samples)
    assert last["eval_loss"] == pytest.approx(_reference_loss(result.final_dir, samples), abs=1e-5)


def test_bad_eval_dataset_stops_before_anything_is_written(llama_dir, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "Only a question?"}]}) + "\n")
    out = tmp_path / "out"
    config = load_config(overrides=dict(model=str(llama_dir), dataset="builtin:chat", chat_template="chatml",
                                        eval_dataset=str(bad), seq_len=256, allow_drop=True, output_dir=str(out)))
    with pytest.raises(UsageError, match="--eval-dataset") as error:
        train(config)
    assert "\n" not in str(error.value)
    assert not out.exists()


def test_epoch_strategy_evaluates_after_each_pass(llama_dir, text_file, tmp_path):
    config = _config(llama_dir, text_file, tmp_path, eval_strategy="epoch", max_steps=1, eval_fraction=0.5)
    from memfit.train.step import StepRunner

    session = build_session(config)
    evaluator = Evaluator.from_session(session, StepRunner.from_session(session))
    per_epoch = session.schedule.steps_per_epoch
    assert evaluator.every == per_epoch
    assert [step for step in range(1, 2 * per_epoch + 1) if evaluator.due(step)] == [1, per_epoch, 2 * per_epoch]


def test_a_resumed_run_keeps_the_best_it_had(llama_dir, text_file, tmp_path):
    """lr 1.0 makes the eval loss rise after the first step: a resumed run must not replace that best model."""
    first = _config(llama_dir, text_file, tmp_path, eval_every=1, save_best=True, max_steps=1, save_every=1)
    train(first)
    best = json.loads((tmp_path / "best.json").read_text())
    weights = (tmp_path / "best" / "model.safetensors").read_bytes()
    train(_config(llama_dir, text_file, tmp_path, eval_every=1, save_best=True, max_steps=3, resume="auto"))
    evals = _eval_lines(tmp_path)
    assert [e["step"] for e in evals] == [1, 2, 3] and min(e["eval_loss"] for e in evals[1:]) > best["eval_loss"]
    assert json.loads((tmp_path / "best.json").read_text()) == best
    assert (tmp_path / "best" / "model.safetensors").read_bytes() == weights


def test_report_shows_the_eval_loss(run):
    from memfit.reporting import load_run
    from memfit.reporting.figures import curves_figure
    from memfit.reporting.page import configuration_rows, glance

    data = load_run(run["out"])
    evals = _eval_lines(run["out"])
    card = [c for c in glance(data) if c[0] == "eval loss"]
    assert card and card[0][1] == f"{evals[-1]['eval_loss']:.4g}" and "best" in card[0][2]
    assert dict(configuration_rows(data))["evaluation"].startswith("2% of the training rows held out, every 1 steps")
    trace = [t for t in curves_figure(data).data if t.name == "eval loss"]
    assert trace and list(trace[0].x) == [1, 2, 3]


def test_memory_cap_splits_a_too_large_eval_batch_only(llama_dir, text_file, tmp_path):
    """A cap that fits the training step but not an eval batch of 48: evaluation halves its own batch."""
    common = dict(max_steps=1, eval_batch_size=48, eval_fraction=0.05)
    free = tmp_path / "free"
    train(_config(llama_dir, text_file, free, track_memory=True, **common))
    phases = _steps(free)[0]["tracked_phase_peaks"]
    training_peak = max(phases["forward"], phases["backward"], phases["optimizer"])
    assert phases["eval"] > training_peak  # 48 samples' logits outweigh 4 samples' step on this model
    cap = (training_peak + phases["eval"]) // 2
    capped = tmp_path / "capped"
    train(_config(llama_dir, text_file, capped, memory_cap=cap, **common))
    ooms = [r for r in read_metrics(capped / "metrics.jsonl") if r.get("event") == "oom"]
    assert ooms and {e["phase"] for e in ooms} == {"eval"}
    (evaluation,) = _eval_lines(capped)
    assert evaluation["eval_batch_size"] < 48
    assert [(s["micro_batch_size"], s["gradient_accumulation_steps"]) for s in _steps(capped)] == [(4, 1)]
    assert evaluation["eval_loss"] == pytest.approx(_eval_lines(free)[0]["eval_loss"], abs=1e-6)


@pytest.mark.gpu
def test_eval_peak_on_cuda_is_at_most_the_steps(llama_dir, text_file, tmp_path):
    """The CUDA allocator's peak of an evaluation stays at or under that of a training step (same micro-batch)."""
    from memfit.train.step import StepRunner

    session = build_session(_config(llama_dir, text_file, tmp_path, precision="bf16"))
    assert session.device.type == "cuda"
    runner = StepRunner.from_session(session)
    samples = [session.dataset[i] for i in session.schedule.batch_indices(0)]
    runner.run(samples)  # the first step allocates the optimizer state; the next one is the steady step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    runner.run(samples)
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = Evaluator.from_session(session, runner).evaluate()
    torch.cuda.synchronize()
    assert result.target_tokens > 0
    assert torch.cuda.max_memory_allocated() <= step_peak


def test_a_held_out_view_counts_one_sample_a_row_unless_its_base_is_packed():
    """A table's `rows` is its row count, a packed set's `rows` its windows' samples: only the latter is summed."""
    from types import SimpleNamespace

    from memfit.train.evaluation import SampleView

    table = SimpleNamespace(rows=120, packing="off", lengths=np.full(120, 40))
    assert SampleView(table, np.arange(24), "evaluation").num_samples == 24
    packed = SimpleNamespace(rows=[[0, 1], [2], [3, 4, 5]], packing="samples", lengths=np.array([60, 30, 64]))
    assert SampleView(packed, np.array([0, 2]), "evaluation").num_samples == 5

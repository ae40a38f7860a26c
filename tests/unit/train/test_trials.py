"""Trials: the planner's best few configurations timed for real, the fastest measured kept, cached, never
changing the run (same weights as the same configuration without trials), an over-cap trial dropped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from memfit.config_loading import load_config
from memfit.prediction.plan_result import PlanResult
from memfit.train import trials
from memfit.train.loop import train

BIG = {"batch_size": 8, "gradient_accumulation_steps": 1, "gradient_checkpointing": "off"}
SMALL = {"batch_size": 1, "gradient_accumulation_steps": 8, "gradient_checkpointing": "full"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache (never the user's ~/.cache/memfit)."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trials, "TRIAL_SHARE", 1e6)  # the tiny runs below are short: let trials run anyway


def _config(llama_dir, text_file, out, **changes):
    values = dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, packing=False, batch_size=8,
                  gradient_accumulation_steps=1, max_steps=2, optimizer="sgd", lr=1.0, max_grad_norm=0,
                  loss_chunk_size=0, output_dir=str(out), report=False)
    return load_config(overrides=values | changes)


def _result(ranked: list[dict], budget: int) -> PlanResult:
    return PlanResult(fits=True, plan=dict(ranked[0]["plan"]), estimated_peak_bytes=ranked[0]["estimated_peak_bytes"],
                      budget_bytes=budget, relative_speed=1.0, command="", ranked=ranked)


def _ranked(*plans, seconds=(0.01, 0.02)):
    return [{"plan": dict(p), "step_seconds": s, "estimated_peak_bytes": 1 << 20} for p, s in zip(plans, seconds, strict=True)]


def _measured_peak(config, plan) -> int:
    trial = trials.Trial(dict(plan), 0.01, 1 << 20)
    trials.time_trial(config, trial, None)
    assert trial.status == "measured", trial.status
    return trial.peak_bytes


def test_over_cap_trial_is_dropped_and_next_taken(llama_dir, text_file, tmp_path):
    """A cap between the two plans' measured peaks: the first (larger) runs out of memory in its trial
    and is dropped, the second is measured and chosen; the run's config is the second's."""
    config = _config(llama_dir, text_file, tmp_path / "run")
    big, small = _measured_peak(config, BIG), _measured_peak(config, SMALL)
    assert small < big
    cap = (big + small) // 2
    chosen, done, why = trials.with_trials(config, _result(_ranked(BIG, SMALL), cap))
    assert [t.status for t in done] == ["over cap", "measured"]
    assert done[1].peak_bytes <= cap
    assert (chosen.training.batch_size, chosen.training.gradient_accumulation_steps) == (1, 8)
    assert chosen.memory.gradient_checkpointing == "full" and "fastest measured" in why
    # trials write nothing in the output directory but the token cache the run reads too
    assert {path.name for path in (tmp_path / "run").iterdir()} <= {"cache"}


def _final_weights(config):
    result = train(config)
    return load_file(str(result.final_dir / "model.safetensors"))


def test_run_after_trials_ends_with_the_weights_of_the_same_plan_without_them(llama_dir, text_file, tmp_path):
    """SGD without clipping at lr 1: any trace of the trials in the run (weights, data order, RNG) shows."""
    with_trials_config = _config(llama_dir, text_file, tmp_path / "with")  # carries the first plan, as planned.py gives it
    planned, done, _ = trials.with_trials(with_trials_config, _result(_ranked(BIG, SMALL), 1 << 40))
    assert all(t.status == "measured" for t in done)
    plan = {k: getattr(planned.training, k) for k in ("batch_size", "gradient_accumulation_steps")}
    plan["gradient_checkpointing"] = planned.memory.gradient_checkpointing
    without = _config(llama_dir, text_file, tmp_path / "without", trial=False, **plan)
    reference = _final_weights(without)
    weights = _final_weights(planned)
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=0, rtol=0, msg=f"{name} differs after trials")
    # and the run really moved the weights: a test that compares unchanged weights proves nothing
    start = load_file(str(llama_dir / "model.safetensors"))
    assert any(not torch.equal(start[name], reference[name]) for name in reference if name in start)


def test_fault_twin_a_trial_that_leaks_its_trained_model_into_the_run_is_caught(llama_dir, text_file, tmp_path,
                                                                              monkeypatch):
    """The comparison above fails when trials leave a trace: here a session cache hands the run the model a
    trial already stepped (the bug such a cache would bring)."""
    import memfit.train.loop as loop
    import memfit.train.setup as setup

    real_build, kept = setup.build_session, {}

    def leaky_build(config):
        session = real_build(config)
        if "model" in kept:
            session.loaded.model.load_state_dict(kept["model"].state_dict())
        kept["model"] = session.loaded.model
        return session

    monkeypatch.setattr(setup, "build_session", leaky_build)
    monkeypatch.setattr(loop, "build_session", leaky_build)
    config = _config(llama_dir, text_file, tmp_path / "with")
    planned, _, _ = trials.with_trials(config, _result(_ranked(BIG, BIG | {"gradient_checkpointing": "full"}), 1 << 40))
    leaked = _final_weights(planned)
    monkeypatch.setattr(setup, "build_session", real_build)
    monkeypatch.setattr(loop, "build_session", real_build)
    clean = _final_weights(planned.replace(output_dir=str(tmp_path / "clean"), trial=False))
    assert any(not torch.equal(leaked[name], clean[name]) for name in clean)


def test_cache_hit_skips_trials_and_keeps_the_choice(llama_dir, text_file, tmp_path, monkeypatch):
    config = _config(llama_dir, text_file, tmp_path / "run")
    ranked = _ranked(BIG, SMALL)
    first, done, _ = trials.with_trials(config, _result(ranked, 1 << 40))
    assert [t.status for t in done] == ["measured", "measured"]
    cache = json.loads((tmp_path / "cache" / "speed.json").read_text())
    assert len(next(iter(cache["trials"].values()))) == 2 and cache["calibration"]  # times and calibration kept

    def no_trial(*args, **kwargs):
        raise AssertionError("a cached configuration was timed again")

    monkeypatch.setattr(trials, "time_trial", no_trial)
    again, cached, _ = trials.with_trials(config, _result(ranked, 1 << 40))
    assert [t.status for t in cached] == ["cached", "cached"]
    assert [t.measured_seconds for t in cached] == [t.measured_seconds for t in done]
    assert again.training.batch_size == first.training.batch_size
    # another cap is another setting: measured again
    with pytest.raises(AssertionError, match="timed again"):
        trials.with_trials(config, _result(ranked, 1 << 39))


def test_no_trial_and_short_runs_time_nothing(llama_dir, text_file, tmp_path, monkeypatch):
    def no_trial(*args, **kwargs):
        raise AssertionError("timed")

    monkeypatch.setattr(trials, "time_trial", no_trial)
    config = _config(llama_dir, text_file, tmp_path / "run", trial=False)
    assert trials.with_trials(config, _result(_ranked(BIG, SMALL), 1 << 40)) == (config, [], "--no-trial")
    monkeypatch.setattr(trials, "TRIAL_SHARE", 0.1)
    config = _config(llama_dir, text_file, tmp_path / "run")
    same, shown, why = trials.with_trials(config, _result(_ranked(BIG, SMALL), 1 << 40))
    assert same is config and why == "too short to repay trials" and all(t.status == "not run" for t in shown)


def test_planned_train_logs_plan_trials_first(llama_dir, text_file, tmp_path):
    """Through memfit.train with --memory-budget: the planner's ranked plans are timed and metrics.jsonl
    starts with what was measured and what won."""
    import memfit

    config = _config(llama_dir, text_file, tmp_path / "run", memory_budget="1GiB", max_steps=2, optimizer="adamw",
                     lr=1e-3)
    result = memfit.train(config)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    record = lines[0]
    assert record["event"] == "plan_trials" and record["chosen_by"] in ("speed model", "trials")
    measured = [c for c in record["candidates"] if c["status"] == "measured"]
    assert len(measured) >= 2 and all(c["measured_seconds"] > 0 and c["peak_bytes"] > 0 for c in measured)
    fastest = min(measured, key=lambda c: c["measured_seconds"])
    assert lines[1]["event"] == "start" and result.steps == 2
    assert fastest["plan"]["batch_size"] == result.summary["micro_batch_size"]


def test_report_shows_the_trials_of_a_planned_run():
    from memfit.reporting.plan_trials import plan_trials_html
    from memfit.reporting.run_data import from_records

    done = [trials.Trial(dict(BIG), 0.2, 3 << 20, None, None, "over cap"),
            trials.Trial(dict(SMALL), 0.3, 1 << 20, 0.25, 900 << 10, "measured")]
    record = trials.plan_trials_record(done, "fastest measured: 0.25 s/step", "trials")
    run = from_records([record, {"event": "start"}, {"step": 1, "loss": 1.0}], "run", "here")
    page = plan_trials_html(run.events)
    assert "Plan trials" in page and "Chosen by trials: fastest measured" in page
    assert page.count("<tr>") == 3 and "over cap" in page and "900.00 KiB" in page
    assert plan_trials_html(from_records([{"event": "start"}], "run", "here").events) == ""


def test_trials_go_to_plans_of_different_shapes_first():
    chunked = [{"plan": BIG | {"loss_chunk_size": c}, "step_seconds": 0.1, "estimated_peak_bytes": 1} for c in (0, 1024)]
    other = {"plan": SMALL, "step_seconds": 0.2, "estimated_peak_bytes": 1}
    order = trials.diverse([*chunked, other])
    assert [r["plan"] for r in order] == [chunked[0]["plan"], SMALL, chunked[1]["plan"]]
    lossy = {"plan": SMALL | {"optimizer": "apollo-mini"}, "step_seconds": 0.05, "estimated_peak_bytes": 1}
    assert lossy not in trials.comparable([chunked[0], lossy])  # never chosen over AdamW for a few measured percent


def test_a_checkpointed_trial_runs_with_its_checkpointing(llama_dir, text_file, tmp_path):
    """The trial trains the model as the run does (train mode): at the same micro-batch, checkpointing lowers
    the trial's tracked peak. A trial of a model left in eval mode skips Hugging Face checkpointing and
    measures the plain peak: the checkpointed plan was then timed without its recompute and dropped as over cap."""
    config = _config(llama_dir, text_file, tmp_path / "run")
    plain = _measured_peak(config, BIG)
    checkpointed = _measured_peak(config, {**BIG, "gradient_checkpointing": "full"})
    assert checkpointed < 0.9 * plain, (checkpointed, plain)


def test_probe_scale_predicts_a_cpu_step_at_the_measured_share_of_the_matmul_probe(monkeypatch):
    """Before calibration a trial's prediction is the model's FLOPs at CPU_PROBE_UTILISATION of the probe's rate
    (0.7, measured on the bench model): with the GPU's 0.45 the bench predicted 3.85 s/step for 2.28 s measured."""
    from memfit.models import flops
    from memfit.prediction import speed_model

    monkeypatch.setattr(flops, "device_peak", lambda device, dtype=None: flops.DevicePeak(130e9, "probe"))
    step_flops = 208.6e9  # the bench model's 2 x 4 step (50.9 MFLOPs per token, 4096 tokens)
    nominal_seconds = step_flops / (speed_model.NOMINAL_TFLOPS * 1e12 * speed_model.UTILISATION)
    predicted = nominal_seconds * trials.probe_scale("cpu")
    assert predicted == pytest.approx(step_flops / (130e9 * 0.7), rel=1e-6)
    assert 2.0 < predicted < 2.6  # the lead's quiet bench run measured 2.28 s


def test_trial_peak_holds_the_optimizer_state_as_the_run_s_later_steps(llama_dir, text_file, tmp_path):
    """AdamW makes its state on the first step; a trial's measured peak is that of a later step of the run
    (memfit profile's second step), state included, not the first step's (without it a trial passed a cap
    that the run's second step broke)."""
    from memfit.train.profiling import profile_run

    plan = {"batch_size": 4, "gradient_accumulation_steps": 2, "gradient_checkpointing": "off"}
    config = _config(llama_dir, text_file, tmp_path / "run", optimizer="adamw", **plan)
    trial_peak = _measured_peak(config, plan)
    report, _ = profile_run(config.replace(max_steps=2))
    first_step, later_step = report.step_peak_bytes
    assert later_step > first_step  # the state the first step made
    assert abs(trial_peak - later_step) <= 0.02 * later_step, (trial_peak, first_step, later_step)


@pytest.mark.parametrize("step_seconds", [0.05, 2.3, 60.0])
def test_a_12_step_run_skips_trials_it_cannot_repay_and_a_long_one_would_not(llama_dir, text_file, tmp_path,
                                                                          monkeypatch, step_seconds):
    """Two trials cost two session builds and 3 + 6 micro-batches; 10 % of a 12-step run is 1.2 steps: whatever the
    step time, a 12-step run (the bench's) skips them. 2000 steps repay them: the trials would run (not run here)."""
    timed = []
    monkeypatch.setattr(trials, "time_trial", lambda config, trial, cap: timed.append(trial) or None)
    monkeypatch.setattr(trials, "TRIAL_SHARE", 0.1)
    monkeypatch.setattr(trials, "probe_scale", lambda device: 1.0)
    two_by_four = {"batch_size": 2, "gradient_accumulation_steps": 4, "gradient_checkpointing": "off"}
    four_by_two = {"batch_size": 4, "gradient_accumulation_steps": 2, "gradient_checkpointing": "selective"}
    ranked = _ranked(two_by_four, four_by_two, seconds=(step_seconds, step_seconds * 0.98))
    config = _config(llama_dir, text_file, tmp_path / "run", max_steps=12)
    _, shown, why = trials.with_trials(config, _result(ranked, 1 << 40))
    assert why == "too short to repay trials" and not timed
    config = _config(llama_dir, text_file, tmp_path / "long", max_steps=2000)
    trials.with_trials(config, _result(ranked, 1 << 40))
    assert len(timed) == 2


def test_a_second_run_whose_ranking_moved_times_only_what_may_beat_the_cached_best(llama_dir, text_file, tmp_path,
                                                                                 monkeypatch):
    """Calibrated by the first run's trials, the second run ranks other configurations beside the cached ones: those
    predicted slower than the fastest measured before are not timed (the run starts at once); one predicted faster is."""
    config = _config(llama_dir, text_file, tmp_path / "run")
    _, done, _ = trials.with_trials(config, _result(_ranked(BIG, SMALL), 1 << 40))
    best = min(t.measured_seconds for t in done)
    other = {"batch_size": 2, "gradient_accumulation_steps": 4, "gradient_checkpointing": "off"}  # never timed
    timed = []
    monkeypatch.setattr(trials, "time_trial", lambda config, trial, cap: timed.append(trial.plan))
    _, second, _ = trials.with_trials(config, _result(_ranked(BIG, other, seconds=(best, 2 * best)), 1 << 40))
    assert timed == [] and [t.status for t in second] == ["cached", trials.SLOWER_THAN_MEASURED]
    _, third, _ = trials.with_trials(config, _result(_ranked(BIG, other, seconds=(best, best / 2)), 1 << 40))
    assert timed == [other]  # predicted faster than the best measured: timed

"""The engine seam: one way to build the step, one host sync per step, the engine's own choices."""

from __future__ import annotations

import pytest
import torch

from memfit.config_loading import load_config
from memfit.train import step as step_module
from memfit.train.batch_size import find_batch_size
from memfit.train.engine import SingleProcessEngine
from memfit.train.loop import train
from memfit.train.step import StepRunner


def _config(llama_dir, text_file, out, **extra):
    values = dict(model=str(llama_dir), dataset=str(text_file), seq_len=32, batch_size=2, max_steps=1,
                  loss_chunk_size=0, output_dir=str(out))
    return load_config(overrides=values | extra)


@pytest.fixture
def built_runners(monkeypatch):
    """Every StepRunner made, with whether it came from from_session."""
    made: list[tuple[StepRunner, bool]] = []
    inside = {"from_session": False}
    original_init, original_from_session = StepRunner.__init__, StepRunner.from_session.__func__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append((self, inside["from_session"]))

    def from_session(cls, session, **kwargs):
        inside["from_session"] = True
        try:
            return original_from_session(cls, session, **kwargs)
        finally:
            inside["from_session"] = False

    monkeypatch.setattr(StepRunner, "__init__", init)
    monkeypatch.setattr(StepRunner, "from_session", classmethod(from_session))
    return made


def _recipe(runner: StepRunner) -> dict:
    """What decides the numbers of a step (the micro-batch size and recovery differ on purpose)."""
    return {
        "engine": type(runner.engine).__name__,
        "precision": runner.precision.name,
        "loss_chunk_size": runner.loss_chunk_size,
        "pad_token_id": runner.pad_token_id,
        "checkpointing_on": runner.checkpointing_on,
        "max_grad_norm": runner.engine.max_grad_norm,
        "trainable": len(runner.trainable),
        "tracked": runner.tracker is not None,
    }


def test_loop_and_batch_size_finder_build_the_same_step(built_runners, llama_dir, text_file, tmp_path):
    """Both make their runner with StepRunner.from_session, and get the same step from the same flags."""
    # 6 MiB: twice what the loop's micro-batch of 2 holds (about 3 MiB), so the finder's doubling stops after a few
    # small probes; 64 MiB let it probe every power of two up to 128 samples under the tracker (8 probes, 255
    # samples) for the same recipe check
    common = dict(memory_cap=6 * 1024**2, max_grad_norm=0.5, track_memory=True)
    train(_config(llama_dir, text_file, tmp_path / "train", **common))
    trained = list(built_runners)
    find_batch_size(_config(llama_dir, text_file, tmp_path / "find", **common), margin=0.1)
    probes = built_runners[len(trained):]
    assert len(trained) == 1 and len(probes) >= 2
    assert all(via_session for _, via_session in built_runners), "a runner was built by hand, not from the session"
    loop_recipe = _recipe(trained[0][0])
    assert loop_recipe["engine"] == "SingleProcessEngine" and loop_recipe["max_grad_norm"] == 0.5
    for runner, _ in probes:
        assert _recipe(runner) == loop_recipe
        assert not runner.oom_recovery  # a probe that runs out of memory does not fit
    assert trained[0][0].oom_recovery


class _Counted(torch.Tensor):
    """A tensor that counts how often its value is read on the host (each read waits for the device)."""

    reads = 0

    def _count(self):
        _Counted.reads += 1

    def item(self):
        self._count()
        return super().item()

    def tolist(self):
        self._count()
        return super().tolist()

    def __float__(self):
        self._count()
        return super().__float__()

    def __bool__(self):
        self._count()
        return super().__bool__()


def test_one_host_sync_per_optimizer_step(llama_dir, text_file, tmp_path, monkeypatch):
    """Four micro-batches: the losses and the gradient norm are read once, together, at the end of the step."""
    original_loss, original_step, original_run = (
        step_module.causal_lm_loss_sum, SingleProcessEngine.clip_and_step, StepRunner.run
    )
    monkeypatch.setattr(step_module, "causal_lm_loss_sum", lambda *a, **k: original_loss(*a, **k).as_subclass(_Counted))
    monkeypatch.setattr(SingleProcessEngine, "clip_and_step", lambda self: original_step(self).as_subclass(_Counted))
    reads_per_step = []

    def run(self, samples, **kwargs):
        before = _Counted.reads
        result = original_run(self, samples, **kwargs)
        reads_per_step.append(_Counted.reads - before)
        return result

    monkeypatch.setattr(StepRunner, "run", run)
    result = train(_config(llama_dir, text_file, tmp_path, batch_size=2, gradient_accumulation_steps=4, max_steps=2))
    assert result.steps == 2 and reads_per_step == [1, 1]
    assert all(loss > 0 for loss in result.losses)


def test_single_process_engine_clip_and_step_returns_the_norm_before_clipping():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    engine = SingleProcessEngine(torch.device("cpu"), _fp32(), max_grad_norm=0.1)
    from memfit.techniques.optimizers import OptimizerChoice

    engine.prepare(model, lambda m: OptimizerChoice(torch.optim.SGD(m.parameters(), lr=1.0), "sgd", ""))
    before = model.weight.detach().clone()
    engine.backward((model(torch.ones(1, 4)) * 10).sum(), last_micro_batch=True)
    grad = model.weight.grad.detach().clone()
    norm = engine.clip_and_step()
    assert isinstance(norm, torch.Tensor)
    torch.testing.assert_close(norm, grad.norm())
    # SGD with lr 1 moves the weights by the clipped gradient: norm 0.1, not the raw one.
    torch.testing.assert_close((before - model.weight.detach()).norm(), torch.tensor(0.1), rtol=1e-5, atol=0)
    assert model.weight.grad is None


def _fp32():
    from memfit.techniques.precision import resolve_precision

    return resolve_precision("fp32", torch.device("cpu"))


def test_every_engine_has_every_member_of_the_interface():
    """The distributed engines satisfy the Protocol by their members (they cannot import train/ to subclass it)."""
    from memfit.distributed.fsdp import FullyShardedEngine
    from memfit.distributed.parallel import DataParallelEngine
    from memfit.distributed.zero import DeepSpeedEngine
    from memfit.train.engine import Engine

    members = {name for name in vars(Engine) if not name.startswith("_")} | set(Engine.__annotations__)
    assert {"prepare", "backward", "reduce_gradients", "clip_and_step", "save_checkpoint", "load_checkpoint",
            "save_final_model", "step_metrics", "summary_metrics"} <= members
    for engine in (SingleProcessEngine, DataParallelEngine, FullyShardedEngine, DeepSpeedEngine):
        instance_attributes = {"model", "optimizer", "scaler"}  # set in __init__ / prepare, or properties
        missing = {name for name in members if not hasattr(engine, name)} - instance_attributes
        assert not missing, f"{engine.__name__} lacks {sorted(missing)}"
        for name in members - instance_attributes:
            if callable(getattr(Engine, name, None)):
                assert callable(getattr(engine, name)), f"{engine.__name__}.{name} is not a method"


def test_a_step_the_grad_scaler_skips_has_a_norm_that_is_not_finite():
    """The runner counts a skipped fp16 step from the norm it reads anyway (no extra read of the scale)."""
    import math

    from memfit.techniques.optimizers import OptimizerChoice
    from memfit.techniques.precision import PrecisionChoice

    fp16 = PrecisionChoice("fp16", torch.float16, True, "test")
    model = torch.nn.Linear(4, 1, bias=False)
    engine = SingleProcessEngine(torch.device("cpu"), fp16, max_grad_norm=1.0)
    assert engine.scaler is not None
    engine.prepare(model, lambda m: OptimizerChoice(torch.optim.SGD(m.parameters(), lr=1.0), "sgd", ""))
    before = model.weight.detach().clone()
    engine.backward(model(torch.ones(1, 4)).sum(), last_micro_batch=True)
    assert math.isfinite(float(engine.clip_and_step()))  # a finite step is taken
    assert not torch.equal(model.weight.detach(), before)
    before = model.weight.detach().clone()
    engine.backward(model(torch.full((1, 4), float("inf"))).sum(), last_micro_batch=True)
    assert not math.isfinite(float(engine.clip_and_step()))
    torch.testing.assert_close(model.weight.detach(), before)  # the scaler skipped the update


def test_library_train_plans_a_budget_as_the_cli_does(monkeypatch):
    """`memfit.train(config)` with a memory budget consults the planner before it builds the run, as `memfit train` does."""
    import memfit
    import memfit.prediction.planner as planner
    from memfit.config_loading import load_config

    class Planned(Exception):
        pass

    def plan(config, budget_bytes=None, gpu=None, **_):
        raise Planned(budget_bytes)

    monkeypatch.setattr(planner, "plan", plan)
    with pytest.raises(Planned) as raised:
        memfit.train(load_config(overrides={"memory_budget": "1GiB", "max_steps": 1}))
    assert raised.value.args == (1 << 30,)


def test_the_next_steps_first_micro_batch_is_prepared_during_this_step(built_runners, llama_dir, text_file, tmp_path):
    """At one micro-batch per step, every step after the first takes a batch prepared ahead."""
    train(_config(llama_dir, text_file, tmp_path / "run", batch_size=2, max_steps=3))
    runner = built_runners[0][0]
    assert (runner.prefetcher.prefetched, runner.prefetcher.collated_on_demand) == (2, 1)


def test_compile_that_ran_eager_says_so(llama_dir, text_file, tmp_path):
    """Under the memory tracker Dynamo compiles nothing: the metrics name what ran, not what was asked."""
    from memfit.techniques.compile import compile_unavailable_reason

    if compile_unavailable_reason(torch.device("cpu")):
        pytest.skip("no C++ compiler: --compile is refused up front")
    result = train(_config(llama_dir, text_file, tmp_path, compile=True, track_memory=True, max_steps=2))
    assert result.summary["compile"] == "off (asked, ran eager)"
    assert "memory tracker" in result.summary["fallbacks"]["compile"]

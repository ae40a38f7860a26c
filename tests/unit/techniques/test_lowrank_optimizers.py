"""GaLore, APOLLO, APOLLO-Mini, Adam-mini and 4-bit AdamW: each update equals the authors' own optimizer called
directly on the same tensors (whole-model and in backward), checkpoints resume to identical weights, and the state
the tracker measures equals the estimator's formula. The runs use plain SGD-free settings where a 2x error shows:
no clipping, a learning rate large enough that the weights move visibly, a projection refreshed every 2 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.memory.tracker import MemoryTracker
from memfit.models.optimizer_state import named_trainable, state_bytes
from memfit.techniques.optimizers import measured_optimizer_state_bytes, parameter_groups
from memfit.techniques.small_state_optimizers import build_run_optimizer, low_rank_settings
from tiny_llama import tiny_llama

galore = pytest.importorskip("galore_torch")
apollo = pytest.importorskip("apollo_torch")
adam_mini = pytest.importorskip("adam_mini")

CPU = torch.device("cpu")
LOW_RANK = ("galore-adamw", "apollo-adamw", "apollo-mini")
FAST = (*LOW_RANK, "adam-mini")
GAP = 2


def _config(optimizer: str, **extra) -> OptimizerConfig:
    return OptimizerConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, optim_rank=4 if optimizer != "apollo-mini"
                           else None, optim_update_proj_gap=GAP, **extra)


def _batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=generator) for _ in range(steps)]


def _backward(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def _run(model, optimizer, batches) -> None:
    for ids in batches:
        _backward(model, ids)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _reference(model, name: str, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The library's optimizer as its authors (and the Trainer) call it: projected Linear weights in one group."""
    betas, common = (config.beta1, config.beta2), {"lr": config.lr, "eps": config.eps}
    if name == "adam-mini":
        return adam_mini.Adam_mini(list(model.named_parameters()), betas=betas, weight_decay=config.weight_decay,
                                   dim=64, n_heads=4, n_kv_heads=2, verbose=False, **common)
    if name == "adamw-4bit":
        from torchao.optim import AdamW4bit

        groups = parameter_groups(model, config.weight_decay)
        return AdamW4bit(groups, betas=betas, weight_decay=config.weight_decay, **common)
    linear = {n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    settings = low_rank_settings(config)
    options = {"rank": settings.rank, "update_proj_gap": GAP, "scale": settings.scale, "proj_type": "std"}
    if name.startswith("apollo"):
        options.update(proj="random", scale_type=settings.scale_type)
    groups = [{"params": [p for n, p in decay if n not in linear], "weight_decay": config.weight_decay},
              {"params": [p for n, p in decay if n in linear], "weight_decay": config.weight_decay, **options},
              {"params": no_decay, "weight_decay": 0.0}]
    if name.startswith("galore"):
        return galore.GaLoreAdamW(groups, betas=betas, no_deprecation_warning=True, **common)
    return apollo.APOLLOAdamW(groups, betas=betas, **common)


def _ours(model, name: str, in_backward: bool = False, **extra) -> torch.optim.Optimizer:
    config = _config(name, **extra)
    return build_run_optimizer(model, parameter_groups(model, config.weight_decay), config, CPU, in_backward,
                               {}).optimizer


def _assert_same_weights(a, b) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def _assert_weights_differ(a, b) -> None:
    assert any(not torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_update_equals_the_library_called_directly(name, in_backward):
    """One step and five (the projections refreshed at steps 0, 2 and 4), against the reference."""
    model, reference = tiny_llama(), tiny_llama()
    ours, theirs = _ours(model, name, in_backward), _reference(reference, name, _config(name))
    batches = _batches(5)
    _run(model, ours, batches[:1])
    _run(reference, theirs, batches[:1])
    _assert_same_weights(model, reference)
    _run(model, ours, batches[1:])
    _run(reference, theirs, batches[1:])
    _assert_same_weights(model, reference)
    _assert_weights_differ(model, tiny_llama())  # the weights moved: the comparison can fail


@pytest.mark.parametrize("name", LOW_RANK)
def test_fault_twin_projection_never_refreshed_differs(name, monkeypatch):
    """The same comparison with the refresh skipped (the projection of step 0 kept) does fail."""
    model, reference = tiny_llama(), tiny_llama()
    ours, theirs = _ours(model, name), _reference(reference, name, _config(name))
    projector = (galore.galore_projector.GaLoreProjector if name.startswith("galore")
                 else __import__("apollo_torch.random_projector", fromlist=["x"]).GradientProjector)
    original = projector.project

    def never_refresh(self, grad, iteration):
        return original(self, grad, iteration if self.ortho_matrix is None else 1)

    batches = _batches(4)
    _run(reference, theirs, batches)
    monkeypatch.setattr(projector, "project", never_refresh)
    _run(model, ours, batches)
    _assert_weights_differ(model, reference)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_checkpoint_resumes_to_identical_weights(name, in_backward, tmp_path):
    """Save after 3 steps (projections made at step 2), load with weights_only=True, 3 more: as if never stopped."""
    model = tiny_llama()
    optimizer = _ours(model, name, in_backward)
    batches = _batches(6)
    _run(model, optimizer, batches[:3])
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed_model = copy.deepcopy(model)
    resumed = _ours(resumed_model, name, in_backward)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    _run(model, optimizer, batches[3:])
    _run(resumed_model, resumed, batches[3:])
    _assert_same_weights(model, resumed_model)


def test_fault_twin_resume_without_projections_differs(tmp_path):
    """Dropping the saved projections (a fresh SVD of the next gradient instead) changes the weights."""
    model = tiny_llama()
    optimizer = _ours(model, "galore-adamw", optim_args="update_proj_gap=3")
    batches = _batches(4)
    _run(model, optimizer, batches[:2])
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        state.pop("projection", None)
    resumed_model = copy.deepcopy(model)
    resumed = _ours(resumed_model, "galore-adamw", optim_args="update_proj_gap=3")
    resumed.load_state_dict(saved)
    _run(model, optimizer, batches[2:])
    _run(resumed_model, resumed, batches[2:])
    _assert_weights_differ(model, resumed_model)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
@pytest.mark.parametrize("targets", ["all-linear", "all", "q_proj,v_proj"])
def test_tracked_state_bytes_equal_the_formula(name, in_backward, targets):
    if targets != "all-linear" and name not in LOW_RANK:
        pytest.skip("only GaLore and APOLLO read --optim-target-modules")
    model = tiny_llama()
    optimizer = _ours(model, name, in_backward, optim_target_modules=targets)
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        _run(model, optimizer, _batches(2))
        tracker.end_step()
        measured = tracker.breakdown()["optimizer_states"]
    config = _config(name, optim_target_modules=targets)
    settings = low_rank_settings(config) if name in LOW_RANK else None
    predicted = state_bytes(name, named_trainable(model), 4, settings, head_block=64 * 64 // 4, in_backward=in_backward)
    assert measured == predicted


def test_low_rank_state_is_small():
    """On a model whose matrices are larger than the rank, the projected state is a fraction of AdamW's."""
    model = tiny_llama(hidden=128, vocab=512)
    tensors = named_trainable(model)
    adamw = 2 * 4 * sum(t.numel for t in tensors)
    for name in LOW_RANK:
        config = _config(name, optim_target_modules="all")
        assert state_bytes(name, tensors, 4, low_rank_settings(config)) < adamw / 4


def test_lora_and_bad_settings_are_refused_in_one_line():
    from memfit.config import TrainConfig

    with pytest.raises(UsageError, match="LoRA adapters are already small"):
        TrainConfig().replace(optimizer="galore-adamw", lora_r=8).validate()
    with pytest.raises(UsageError, match="--optim-rank must be at least 1"):
        TrainConfig().replace(optimizer="apollo-adamw", optim_rank=0).validate()
    with pytest.raises(UsageError, match="optim-args takes key=value"):
        low_rank_settings(OptimizerConfig(optimizer="galore-adamw", optim_args="ranks=4"))
    with pytest.raises(UsageError, match="selects no Linear weight"):
        _ours(tiny_llama(), "galore-adamw", optim_target_modules="no_such_module")


def test_sharded_engines_refuse_them_and_ddp_runs_them():
    from memfit.config import TrainConfig
    from memfit.resolution.resolve import resolve

    engines = {"--sharding fsdp": {"sharding": "fsdp"}, "DeepSpeed": {"zero_stage": 2}, "--sharding ddp": {"sharding": "ddp"}}

    def resolve_under(name: str, engine: str):  # the optimizer technique's refusals read the engine of the run
        return resolve(TrainConfig().replace(optimizer=name, **engines[engine]), None, "cpu", world_size=2)

    for name in (*LOW_RANK, "adam-mini", "adamw-4bit", "galore-adamw-8bit"):
        for engine in ("--sharding fsdp", "DeepSpeed"):
            if (name, engine) == ("adamw-4bit", "--sharding fsdp"):
                continue  # torchao's 4-bit AdamW steps and checkpoints FSDP2 shards (tests/distributed)
            with pytest.raises(UsageError, match=f"--optimizer {name}.*use --sharding ddp"):
                resolve_under(name, engine)
        resolve_under(name, "--sharding ddp")
    resolve_under("adamw-4bit", "--sharding fsdp")


def test_trainer_names_are_aliases():
    from memfit.config_loading import load_config

    for hf, ours in (("galore_adamw", "galore-adamw"), ("galore_adamw_8bit", "galore-adamw-8bit"),
                     ("apollo_adamw", "apollo-adamw"), ("adam_mini", "adam-mini"), ("adamw_torch_4bit", "adamw-4bit")):
        config = load_config(overrides={"optim": hf, "optim_target_modules": ["q_proj", "v_proj"]})
        assert config.optimizer.optimizer == ours
        assert config.optimizer.optim_target_modules == "q_proj,v_proj"


@pytest.mark.slow
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_adamw_4bit_equals_torchao_and_resumes(in_backward, tmp_path):
    """torchao compiles its step per shape (tens of seconds on 2 cores the first time): one test covers it."""
    pytest.importorskip("torchao")
    model, reference = tiny_llama(), tiny_llama()
    ours, theirs = _ours(model, "adamw-4bit", in_backward), _reference(reference, "adamw-4bit", _config("adamw-4bit"))
    batches = _batches(4)
    _run(model, ours, batches[:2])
    _run(reference, theirs, batches[:2])
    _assert_same_weights(model, reference)
    torch.save(ours.state_dict(), tmp_path / "optimizer.pt")
    resumed_model = copy.deepcopy(model)
    resumed = _ours(resumed_model, "adamw-4bit", in_backward)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    _run(model, ours, batches[2:])
    _run(resumed_model, resumed, batches[2:])
    _assert_same_weights(model, resumed_model)
    tensors = named_trainable(model)
    inner = list(ours.optimizers.values()) if in_backward else [ours]
    assert sum(map(measured_optimizer_state_bytes, inner)) == state_bytes("adamw-4bit", tensors, 4, None)


@pytest.mark.parametrize("name", (*FAST, "adamw-4bit", "galore-adamw-8bit"))
def test_the_estimator_counts_the_same_tensors_as_the_real_model(name):
    """The estimator's inventory (a meta-device build) names and shapes the tensors as the loaded model does."""
    from memfit.models.state_bytes import parameter_inventory, small_state_optimizer_bytes
    from tiny_llama import tiny_llama_config

    config = _config(name, optim_target_modules="all-linear")
    settings = low_rank_settings(config) if name not in ("adam-mini", "adamw-4bit") else None
    real = state_bytes(name, named_trainable(tiny_llama()), 4, settings, head_block=64 * 64 // 4)
    assert small_state_optimizer_bytes(config, parameter_inventory(tiny_llama_config()), 4, False) == real


@pytest.mark.parametrize("name", FAST)
def test_a_state_cleared_before_the_first_step_still_steps_as_the_library(name):
    """OOM recovery in the first optimizer step clears the state (memfit.train.engine) and steps again."""
    model, reference = tiny_llama(), tiny_llama()
    ours, theirs = _ours(model, name), _reference(reference, name, _config(name))
    ours.state.clear()
    batches = _batches(3)
    _run(model, ours, batches)
    _run(reference, theirs, batches)
    _assert_same_weights(model, reference)


def test_every_small_state_optimizer_has_all_its_rows_in_one_module():
    """Adding an optimizer touches memfit.models.optimizer_state (and the factory): each table there names it."""
    from memfit.config import SMALL_STATE_OPTIMIZERS
    from memfit.models.optimizer_state import PLANNING, STEP_TEMPORARY_FACTOR

    assert set(PLANNING) == set(STEP_TEMPORARY_FACTOR) == set(SMALL_STATE_OPTIMIZERS)
    assert all(facts.distance_from_adamw > 0 for facts in PLANNING.values())  # none of them is AdamW

"""GRPO's objective against TRL 1.16's own code: `grpo_loss` gives GRPOTrainer._compute_loss's loss, gradient w.r.t.
the per-token log-probabilities and clip/KL metrics for each loss type, beta 0 and 0.04, once-trained and twice-trained
completions (old log-probabilities differing from the current ones), with epsilon_high set; the micro-batch shares of
a step sum to the loss of the step in one batch; `group_advantages` gives TRL's advantages and reward metrics.

TRL computes the loss in a method of the trainer that reads a handful of its attributes; the test calls it on an
instance made with `object.__new__(GRPOTrainer)` that carries just those, its log-probability method replaced by one
that returns the test's tensors, so no model, dataset or accelerator is built.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from memfit.tasks.grpo_losses import LOSS_TYPES, SCALE_REWARDS, group_advantages, grpo_loss

COMPLETIONS, MAX_LENGTH = 6, 7
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28


@pytest.fixture(scope="module")
def grpo_trainer_class():
    return pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer


def completions(seed: int, twice_trained: bool):
    """Random per-token log-probabilities and a ragged mask; old ones differ enough for both clips to act."""
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(COMPLETIONS, MAX_LENGTH, generator=generator, dtype=torch.float64) * 3
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(MAX_LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    old = logps + torch.randn(logps.shape, generator=generator, dtype=torch.float64) * 0.4 if twice_trained else None
    ref = logps + torch.randn(logps.shape, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(COMPLETIONS, generator=generator, dtype=torch.float64)
    entropies = torch.rand(logps.shape, generator=generator, dtype=torch.float64)
    return logps, mask, old, ref, advantages, entropies


def trl_loss(trainer_class, loss_type, beta, logps, mask, old, ref, advantages, entropies):
    """TRL's `_compute_loss` on these tensors, one process, one micro-batch; returns the loss and TRL's metrics."""
    trainer = object.__new__(trainer_class)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, use_vllm=False,
        max_completion_length=MAX_LENGTH, current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
    )
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    inputs = {
        "prompt_ids": torch.zeros(COMPLETIONS, 2, dtype=torch.long), "prompt_mask": torch.ones(COMPLETIONS, 2),
        "completion_ids": torch.zeros(COMPLETIONS, MAX_LENGTH, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    loss = trainer._compute_loss(model=None, inputs=inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def memfit_loss(loss_type, beta, logps, mask, old, ref, advantages, entropies, **scale):
    return grpo_loss(
        logps, mask, advantages, old_per_token_logps=old, ref_per_token_logps=ref, loss_type=loss_type, beta=beta,
        epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, max_completion_length=MAX_LENGTH,
        completions_in_step=scale.get("completions_in_step", COMPLETIONS),
        tokens_in_step=scale.get("tokens_in_step", mask.sum()), entropies=entropies,
    )


@pytest.mark.parametrize("twice_trained", [False, True], ids=["num_iterations1", "num_iterations2"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trl(grpo_trainer_class, loss_type, beta, twice_trained):
    logps, mask, old, ref, advantages, entropies = completions(seed=3, twice_trained=twice_trained)
    ours_logps = logps.clone().requires_grad_()
    theirs_logps = logps.clone().requires_grad_()
    ours, stats = memfit_loss(loss_type, beta, ours_logps, mask, old, ref, advantages, entropies)
    theirs, metrics = trl_loss(grpo_trainer_class, loss_type, beta, theirs_logps, mask, old, ref, advantages, entropies)
    (ours_grad,) = torch.autograd.grad(ours, ours_logps)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logps)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_grad, theirs_grad)
    assert ours_grad.abs().sum() > 0
    tokens = stats["tokens"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert (stats[name] / tokens).item() == pytest.approx(metrics[name]), name
    if beta:
        assert (stats["kl"] / tokens).item() == pytest.approx(metrics["kl"])
    if twice_trained:  # the old log-probabilities are far enough for both clips to act
        assert stats["clip_ratio/low_mean"] > 0 and stats["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_shares_sum_to_the_step_loss(loss_type):
    logps, mask, old, ref, advantages, entropies = completions(seed=5, twice_trained=True)
    whole_logps = logps.clone().requires_grad_()
    whole, _ = memfit_loss(loss_type, 0.04, whole_logps, mask, old, ref, advantages, entropies)
    (whole_grad,) = torch.autograd.grad(whole, whole_logps)
    parts_logps = logps.clone().requires_grad_()
    step = {"completions_in_step": COMPLETIONS, "tokens_in_step": mask.sum()}
    total = 0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # unequal micro-batches with unequal token counts
        share, _ = memfit_loss(loss_type, 0.04, parts_logps[rows], mask[rows], old[rows], ref[rows], advantages[rows],
                               entropies[rows], **step)
        total = total + share
    (parts_grad,) = torch.autograd.grad(total, parts_logps)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(parts_grad, whole_grad)


def trl_advantages(rewards, num_generations, scale_rewards):
    """TRL's advantage formulas (grpo_trainer.py, `_generate_and_score_completions`, sum_then_normalize) with TRL's
    own nanstd: group mean, std over the group or the batch, + 1e-4, NaN advantages zeroed."""
    from trl.trainer.utils import nanstd

    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return torch.nan_to_num(advantages, nan=0.0), zero_std


@pytest.mark.parametrize("scale_rewards", SCALE_REWARDS)
def test_group_advantages_equal_trl(grpo_trainer_class, scale_rewards):
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 3.0, float("nan"), 0.0, 1.0])
    ours, stats = group_advantages(rewards, num_generations=4, scale_rewards=scale_rewards)
    theirs, zero_std = trl_advantages(rewards, 4, scale_rewards)
    torch.testing.assert_close(ours, theirs)
    assert stats["frac_reward_zero_std"] == pytest.approx(zero_std) 
    assert zero_std == pytest.approx(0.0 if scale_rewards == "batch" else 4 / 12)
    assert stats["reward"] == pytest.approx(torch.nanmean(rewards).item())
    assert stats["reward_std"] == pytest.approx(nanstd(rewards).item())
    assert ours[9] == 0.0 and ours[4:8].abs().max() == 0.0  # the unscored completion and the tied group


def test_group_advantages_refuse_a_ragged_batch():
    with pytest.raises(ValueError, match="prompts x 4"):
        group_advantages(torch.zeros(6), num_generations=4, scale_rewards="group")

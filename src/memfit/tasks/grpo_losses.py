"""GRPO's objective as pure functions: group advantages and the clipped policy-gradient loss.

Semantics are TRL 1.16's (GRPOTrainer `_generate_and_score_completions` and `_compute_loss`; the
tests compare against TRL's own code on the same inputs):

Advantages: the completions of one prompt are consecutive, G = num_generations of them. With r the
weighted reward of each completion, A = r - mean over its group, divided by (std + 1e-4) where the
std (Bessel-corrected, NaN-aware) is the group's ("group"), the whole batch's ("batch"), or not
applied ("none", Dr. GRPO). A reward that is NaN (every function returned None) is left out of the
means and gets advantage 0.

Loss, per completion token t, with ratio rho = exp(logp - logp_old) and advantage A of the completion:
    l_t = -min(rho A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A) + beta kl_t,
    kl_t = exp(logp_ref - logp) - (logp_ref - logp) - 1          (the k3 estimator)
When the completions are trained once (num_iterations 1) the old policy is the current one: rho is
1 in value and its gradient is that of exp(logp - logp.detach()).

Normalisation: `grpo_loss` returns one micro-batch's share of the optimizer step's loss, so that the
shares of every micro-batch of the step (and of the halves of a micro-batch split after an
out-of-memory) sum to the loss over all the step's completions:
    dapo     token sum / tokens in the step
    bnpo     token sum / tokens in the step (the same as dapo over a whole step)
    grpo     sum over completions of (token sum / completion length) / completions in the step
    dr_grpo  token sum / (completions in the step x max_completion_length)
On one micro-batch this is TRL's value. Under accumulation TRL divides bnpo by each micro-batch's own
token count and grpo, bnpo and dr_grpo by the number of micro-batches (the mean of per-micro-batch
means), which differs from the step's loss when micro-batches hold different token counts; memfit
normalises over the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4
"""Added to the reward's standard deviation before dividing (TRL's constant)."""


def _nan_std(values: Tensor, dim: int | None = None) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN where fewer than two values)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    squares = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True)
    variance = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.full_like(squares, float("nan")))
    return variance.sqrt().squeeze(dim)


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str) -> tuple[Tensor, dict[str, float]]:
    """Each completion's advantage over the other completions of its prompt.

    Args:
        rewards: [N] weighted rewards, N = prompts x num_generations, a prompt's completions consecutive;
            NaN for a completion no reward function scored.
        num_generations: completions per prompt (G).
        scale_rewards: "group", "batch" or "none": which standard deviation divides the advantage.

    Returns:
        advantages [N] (0 where the reward is NaN) and the metrics under TRL's names: reward (mean),
        reward_std (over the batch), frac_reward_zero_std (share of completions whose std is 0).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be [prompts x {num_generations}], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    groups = rewards.view(-1, num_generations)
    group_mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = _nan_std(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - group_mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    stats = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": _nan_std(rewards).item(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
    }
    return advantages, stats


STAT_NAMES = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy")
"""The stats `grpo_loss` sums over tokens, under TRL's metric names; divide each by the summed "tokens"."""


def token_losses(per_token_logps: Tensor, advantage: Tensor, old_per_token_logps: Tensor | None,
                 ref_per_token_logps: Tensor | None, *, beta: float, epsilon_low: float, epsilon_high: float
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(each token's loss l_t, its ratio rho, its kl_t: 0 when beta is 0), elementwise (the module docstring).

    `advantage` broadcasts against the log-probabilities (a completion's, one a row); `old_per_token_logps` None:
    the completions are trained once (rho is 1 with the policy's gradient)."""
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    token_loss = -torch.min(ratio * advantage, clipped_ratio * advantage)
    if beta != 0.0:
        log_ratio_to_ref = ref_per_token_logps - per_token_logps
        token_kl = torch.exp(log_ratio_to_ref) - log_ratio_to_ref - 1
        token_loss = token_loss + beta * token_kl
    else:
        token_kl = torch.zeros_like(per_token_logps)
    return token_loss, ratio, token_kl


def token_weights(
    mask: Tensor, loss_type: str, *, max_completion_length: int, completions_in_step: int,
    tokens_in_step: int | Tensor,
) -> Tensor:
    """`[B, T]` what each token's loss counts for in this micro-batch's share of the step's loss under `loss_type`
    (the module docstring): the share is the weighted sum of the token losses, 0 off the mask."""
    if loss_type in ("dapo", "bnpo"):
        denominator = torch.as_tensor(tokens_in_step, dtype=mask.dtype, device=mask.device)
        return mask / denominator.clamp(min=1.0)
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * completions_in_step)
    if loss_type == "dr_grpo":
        return mask / (completions_in_step * max_completion_length)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def grpo_loss(
    per_token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    old_per_token_logps: Tensor | None = None,
    ref_per_token_logps: Tensor | None = None,
    loss_type: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    max_completion_length: int,
    completions_in_step: int,
    tokens_in_step: int | Tensor,
    entropies: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy-gradient loss of one micro-batch, as its share of the optimizer step's loss.

    Args:
        per_token_logps: [B, T] log-probabilities of the completion tokens under the trained policy.
        completion_mask: [B, T] 1 for completion tokens in the loss, 0 for padding (and masked truncations).
        advantages: [B] each completion's advantage (`group_advantages`).
        old_per_token_logps: [B, T] under the policy that generated the completions; None when the
            completions are trained once (the ratio is then 1 with the policy's gradient).
        ref_per_token_logps: [B, T] under the frozen reference; needed when beta > 0.
        loss_type: "dapo", "bnpo", "grpo" or "dr_grpo": how token losses are normalised.
        beta: coefficient of the per-token KL to the reference.
        epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high].
        max_completion_length: dr_grpo's constant length.
        completions_in_step: completions in the whole optimizer step (all micro-batches). Under data parallelism,
            where the engine averages gradients over ranks, the count of one rank's share: the global count divided by
            the number of ranks (as TRL divides `num_items_in_batch` by `num_processes`).
        tokens_in_step: completion tokens in the loss over the whole step (all micro-batches); under data
            parallelism, likewise the global count divided by the number of ranks.
        entropies: [B, T] per-token entropies, only summed into the stats.

    Returns:
        The loss share (a scalar with the policy's gradient) and detached sums over this micro-batch's
        tokens: "tokens" (the mask's sum) and each of STAT_NAMES (kl is 0 when beta is 0; entropy only
        when given). Add them over micro-batches; a metric is its sum over the summed tokens.
    """
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta > 0 needs ref_per_token_logps (the reference's per-token log-probabilities)")
    mask = completion_mask.to(per_token_logps.dtype)
    advantage = advantages.to(per_token_logps.dtype).unsqueeze(1)
    token_loss, ratio, token_kl = token_losses(per_token_logps, advantage, old_per_token_logps, ref_per_token_logps,
                                               beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    loss = (token_loss * token_weights(mask, loss_type, max_completion_length=max_completion_length,
                                       completions_in_step=completions_in_step, tokens_in_step=tokens_in_step)).sum()
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (advantage < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (advantage > 0)).to(mask.dtype)
        stats = {
            "tokens": mask.sum(),
            "kl": (token_kl * mask).sum(),
            "clip_ratio/low_mean": (low * mask).sum(),
            "clip_ratio/high_mean": (high * mask).sum(),
            "clip_ratio/region_mean": (torch.clamp(low + high, max=1.0) * mask).sum(),
        }
        if entropies is not None:
            stats["entropy"] = (entropies * mask).sum()
    return loss, {name: value.detach() for name, value in stats.items()}


def gradient_ahead(advantage: Tensor, old_per_token_logps: Tensor | None, ref_per_token_logps: Tensor | None,
                   weights: Tensor, *, beta: float, epsilon_low: float, epsilon_high: float
                   ) -> Callable[[Tensor, Tensor], Tensor]:
    """`(positions, log-probabilities) -> the gradient of the loss share with respect to them`, from the values
    alone: the share is the weighted sum of elementwise token losses, so a token's gradient depends on its own value
    (techniques/sequence_logprobs.py takes each chunk's gradients in forward with it).

    `advantage` (each token's completion's), the old and reference log-probabilities (None where absent) and the
    `token_weights`: flat, one value a position of the layout `positions` index.
    """
    def gradient(positions: Tensor, values: Tensor) -> Tensor:
        def at(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor[positions].to(values.device)

        with torch.enable_grad():
            leaf = values.detach().float().requires_grad_()
            token_loss = token_losses(leaf, at(advantage), at(old_per_token_logps), at(ref_per_token_logps),
                                      beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high)[0]
            (grad,) = torch.autograd.grad((token_loss * at(weights)).sum(), leaf)
        return grad

    return gradient

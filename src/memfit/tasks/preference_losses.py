"""Preference objectives as pure functions of completion log-probabilities: DPO, SimPO, ORPO and KTO.

Each objective reads, per completion, the summed log-probability of its tokens and their count
under the trained policy (and, for DPO and KTO, under a frozen reference), as
techniques/sequence_logprobs.py computes them without the batch's logits. It returns each
pair's (each example's, for KTO) loss, the batch's loss, and the metrics under the names TRL
logs, so that runs compare line for line. The formulas, defaults and normalisations are those
of TRL 1.16 (the tests call TRL's own loss code on the same inputs):

DPO (DPOTrainer, `f_divergence_type="reverse_kl"`, one loss type, no weighting), with
    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)), summed log-probabilities:
    sigmoid  -log sigmoid(beta h)
    hinge    relu(1 - beta h)
    ipo      (h_avg - 1 / (2 beta))^2, where h_avg divides each completion's log-ratio by its
             token count (at least 1) before the difference: TRL's length normalisation of IPO
    robust   (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps), eps = label_smoothing
    batch loss: the mean over pairs. rewards/chosen = beta (log pi(y_w) - log ref(y_w)) on sums, for
    every loss type.
SimPO (CPOTrainer with loss_type "simpo", `alpha=0`), on average log-probabilities a = sum / count:
    m = a_w - a_l - gamma / beta; loss = -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)
    batch loss: mean over pairs + cpo_alpha x NLL, the NLL being the mean token cross-entropy over
    all chosen completion tokens of the batch (0 when cpo_alpha is 0). rewards = beta x a.
ORPO (ORPOTrainer), on average log-probabilities:
    log_odds = (a_w - a_l) - (log(1 - e^a_w) - log(1 - e^a_l)); loss = -beta log sigmoid(log_odds)
    batch loss: NLL + mean over pairs, the NLL being the mean token cross-entropy over every real
    token of the chosen rows, prompt included (TRL's choice). rewards = beta x a.
KTO (KTOTrainer, loss_type "kto"), on summed log-probabilities, r = log pi(y) - log ref(y):
    desirable    desirable_weight x (1 - sigmoid(beta (r - z)))
    undesirable  undesirable_weight x (1 - sigmoid(beta (z - r)))
    batch loss: the mean over examples. z is the KL estimate `kto_kl_estimate`: the mean over
    the batch of log pi(y') - log ref(y') for mismatched completions y' (TRL pairs each prompt
    with the previous example's completion, x_i with y_(i-1), rotating within a batch),
    detached and clamped at 0. What is implemented: the loss, the weights and the estimate over
    the micro-batch given; TRL also averages the estimate over processes (`gather_for_metrics`)
    before clamping, which a multi-process caller does by averaging before `kto_loss`.
    Not implemented: TRL's "apo_zero_unpaired" loss type.

Batches: each batch loss is a mean over the pairs (for the NLL terms, over the tokens) of the
batch given, as TRL's is per micro-batch; `PreferenceLoss.losses` lets a caller that accumulates
micro-batches normalise over the effective batch instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memfit.techniques.sequence_logprobs import SequenceLogprobs

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


@dataclass
class PairLogprobs:
    """One model's log-probabilities of each pair's two completions, and their lengths."""

    chosen: torch.Tensor
    """`[pairs]` summed log-probability of each chosen (preferred) completion."""
    rejected: torch.Tensor
    """`[pairs]` summed log-probability of each rejected completion."""
    chosen_tokens: torch.Tensor
    """`[pairs]` tokens in each chosen completion (what its sum covers)."""
    rejected_tokens: torch.Tensor
    """`[pairs]` tokens in each rejected completion."""

    @classmethod
    def from_rows(cls, rows: SequenceLogprobs) -> PairLogprobs:
        """Split a batch of rows laid out as all chosen completions, then all rejected ones (pair i: rows i and
        pairs + i), the layout of TRL's concatenated forward: one forward scores both sides."""
        chosen, rejected = rows.sums.chunk(2)
        chosen_tokens, rejected_tokens = rows.token_counts.chunk(2)
        return cls(chosen, rejected, chosen_tokens, rejected_tokens)

    @property
    def chosen_means(self) -> torch.Tensor:
        """`[pairs]` average log-probability per token of each chosen completion (SimPO's and ORPO's score)."""
        return self.chosen / self.chosen_tokens.clamp(min=1)

    @property
    def rejected_means(self) -> torch.Tensor:
        """`[pairs]` average log-probability per token of each rejected completion."""
        return self.rejected / self.rejected_tokens.clamp(min=1)


@dataclass
class PreferenceLoss:
    """What one objective makes of a batch."""

    loss: torch.Tensor
    """Scalar fp32: the batch's objective, what backward runs on (TRL's `loss`)."""
    losses: torch.Tensor
    """`[pairs]` (`[examples]` for KTO, in the batch's order) each one's preference term, extra terms excluded."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached scalars under TRL's names (rewards/chosen, rewards/margins, logps/chosen, nll_loss, kl, ...);
    tensors, so that logging decides when to synchronise with the device."""


@dataclass
class DPOSettings:
    """DPO's hyperparameters, with TRL's DPOConfig defaults."""

    loss_type: str = "sigmoid"
    """One of DPO_LOSS_TYPES: "sigmoid" (DPO), "hinge" (SLiC), "ipo" (IPO, length-normalised), "robust" (rDPO)."""
    beta: float = 0.1
    """How far from the reference the policy may go: the scale of the log-ratio (IPO's regulariser tau)."""
    label_smoothing: float = 0.0
    """Robust DPO's probability that a pair's preference is flipped, in [0, 0.5); only "robust" reads it."""

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"DPO loss_type {self.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
        if self.beta <= 0:
            raise ValueError(f"DPO beta must be positive, got {self.beta}")
        if self.loss_type == "robust" and not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"robust DPO's label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type != "robust" and self.label_smoothing:
            # TRL 1.16's other loss types ignore it: say so rather than train something else than asked
            raise ValueError(f"label_smoothing applies to DPO loss_type 'robust' only, not {self.loss_type!r}")


@dataclass
class SimPOSettings:
    """SimPO's hyperparameters, with TRL's CPOConfig defaults (the SimPO paper uses cpo_alpha 0 and a beta near 2)."""

    beta: float = 0.1
    """The scale of the difference of average log-probabilities."""
    simpo_gamma: float = 0.5
    """The target reward margin: the loss wants beta x (a_w - a_l) above it."""
    label_smoothing: float = 0.0
    """Weight of the flipped-preference term (conservative loss); 0 is plain SimPO."""
    cpo_alpha: float = 1.0
    """Weight of the NLL of the chosen completions added to the batch loss (CPO's behaviour-cloning term)."""


@dataclass
class ORPOSettings:
    """ORPO's hyperparameter, with TRL's ORPOConfig default."""

    beta: float = 0.1
    """Weight of the odds-ratio term against the NLL (the paper's lambda)."""


@dataclass
class KTOSettings:
    """KTO's hyperparameters, with TRL's KTOConfig defaults."""

    beta: float = 0.1
    """How far from the reference the policy may go: the scale of the log-ratio."""
    desirable_weight: float = 1.0
    """Weight of each desirable example's loss (raise it when desirable examples are the fewer)."""
    undesirable_weight: float = 1.0
    """Weight of each undesirable example's loss."""


def dpo_loss(policy: PairLogprobs, reference: PairLogprobs, settings: DPOSettings | None = None) -> PreferenceLoss:
    """DPO's loss of each pair and of the batch from policy and reference summed log-probabilities (module docstring)."""
    settings = settings or DPOSettings()
    beta = settings.beta
    chosen_logratios = policy.chosen - reference.chosen
    rejected_logratios = policy.rejected - reference.rejected
    margin = chosen_logratios - rejected_logratios
    if settings.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin)
    elif settings.loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif settings.loss_type == "ipo":
        # per-token log-ratios: a squared loss of sums would grow with the completions' length
        average_margin = (chosen_logratios / policy.chosen_tokens.clamp(min=1)
                          - rejected_logratios / policy.rejected_tokens.clamp(min=1))
        losses = (average_margin - 1 / (2 * beta)) ** 2
    else:  # robust: unbiased under preferences flipped with probability label_smoothing
        flip = settings.label_smoothing
        losses = (-(1 - flip) * F.logsigmoid(beta * margin) + flip * F.logsigmoid(-beta * margin)) / (1 - 2 * flip)
    metrics = _reward_metrics(beta * chosen_logratios, beta * rejected_logratios, policy.chosen, policy.rejected)
    return PreferenceLoss(losses.mean(), losses, metrics)


def simpo_loss(policy: PairLogprobs, settings: SimPOSettings | None = None) -> PreferenceLoss:
    """SimPO's loss (no reference model) of each pair, and the batch's with the chosen NLL (module docstring)."""
    settings = settings or SimPOSettings()
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen, rejected = policy.chosen_means, policy.rejected_means
    margin = chosen - rejected - settings.simpo_gamma / beta
    losses = -(1 - smoothing) * F.logsigmoid(beta * margin) - smoothing * F.logsigmoid(-beta * margin)
    nll = _chosen_token_nll(policy.chosen, policy.chosen_tokens) if settings.cpo_alpha else losses.new_zeros(())
    metrics = _reward_metrics(beta * chosen, beta * rejected, chosen, rejected)
    metrics["nll_loss"] = nll.detach()
    return PreferenceLoss(losses.mean() + settings.cpo_alpha * nll, losses, metrics)


def orpo_loss(policy: PairLogprobs, chosen_sequence_logps: torch.Tensor, chosen_sequence_tokens: torch.Tensor,
              settings: ORPOSettings | None = None) -> PreferenceLoss:
    """ORPO's odds-ratio loss of each pair, and the batch's with the NLL of the chosen rows (module docstring).

    `policy`: the completions' summed log-probabilities. `chosen_sequence_logps`, `chosen_sequence_tokens`:
    `[pairs]` summed log-probability and count of every real token of each chosen row, prompt included,
    what ORPO's NLL averages over (`SequenceLogprobs.restricted_to` gets the completions' from the same forward).
    """
    settings = settings or ORPOSettings()
    chosen, rejected = policy.chosen_means.float(), policy.rejected_means.float()
    log_odds = (chosen - rejected) - (_log_one_minus_exp(chosen) - _log_one_minus_exp(rejected))
    log_odds_ratio = F.logsigmoid(log_odds)
    losses = -settings.beta * log_odds_ratio
    nll = _chosen_token_nll(chosen_sequence_logps, chosen_sequence_tokens)
    metrics = _reward_metrics(settings.beta * chosen, settings.beta * rejected, chosen, rejected)
    metrics.update(nll_loss=nll.detach(), log_odds_ratio=log_odds_ratio.detach().mean(),
                   log_odds_chosen=log_odds.detach().mean())
    return PreferenceLoss(nll + losses.mean(), losses, metrics)


def kto_kl_estimate(policy_mismatched_logps: torch.Tensor, reference_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z: the batch's mean log-ratio of mismatched (prompt, completion) pairs, at least 0.

    Both `[examples]` summed log-probabilities of the same mismatched completions (each prompt with
    another example's completion; TRL rotates by one). Detached: z is a baseline, not trained through.
    A multi-process caller averages the unclamped means over processes first, as TRL does.
    """
    return (policy_mismatched_logps - reference_mismatched_logps).mean().detach().clamp(min=0)


def kto_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor | float, settings: KTOSettings | None = None) -> PreferenceLoss:
    """KTO's loss of each unpaired example and of the batch (module docstring).

    `policy_logps`, `reference_logps`: `[examples]` summed log-probabilities of each completion.
    `desirable`: `[examples]` bool, whether the completion is a desirable one (TRL's `label`).
    `kl`: the reference point z (`kto_kl_estimate`).
    """
    settings = settings or KTOSettings()
    beta = settings.beta
    desirable = desirable.to(torch.bool)
    logratios = policy_logps - reference_logps
    desirable_losses = settings.desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    undesirable_losses = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)

    metrics = {"kl": torch.as_tensor(kl, dtype=torch.float32).detach()}
    rewards = beta * logratios.detach()
    # TRL logs each side only when the batch has examples of it, and the margin only when it has both
    # (masked sums, not boolean indexing: the traced estimate runs this on fake tensors, whose selections have no shape)
    for side, mask in (("chosen", desirable), ("rejected", ~desirable)):
        if mask.any():
            count = mask.sum()
            metrics[f"rewards/{side}"] = torch.where(mask, rewards, 0).nansum() / count
            metrics[f"logps/{side}"] = torch.where(mask, policy_logps.detach(), 0).nansum() / count
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceLoss(losses.nanmean(), losses, metrics)


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                    rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics every paired objective logs, under TRL's names: the batch means of the implicit rewards, their
    margin and how often the chosen one is higher, and of the scores the loss read (sums or averages)."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def _chosen_token_nll(summed_logps: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per token over all the rows' tokens together (a mean over tokens, not over rows)."""
    return -summed_logps.sum() / token_counts.sum()


def _log_one_minus_exp(log_p: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2."""
    return torch.where(log_p < -math.log(2), torch.log1p(-torch.exp(log_p)), torch.log(-torch.expm1(log_p)))

"""The preference objectives as tasks: DPO (and IPO, hinge, robust), SimPO, ORPO and KTO, each the shared
PreferenceTask (memfit.tasks.preference) with its loss and the settings it reads."""

from __future__ import annotations

from typing import Any

import torch

from memfit.tasks.preference import REFERENCE_SETTINGS, PreferenceTask
from memfit.tasks.preference_losses import (
    DPOSettings,
    KTOSettings,
    ORPOSettings,
    PairLogprobs,
    SimPOSettings,
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_loss,
    simpo_loss,
)


class DPOTask(PreferenceTask):
    """DPO (--loss-type sigmoid, hinge, ipo or robust) against the reference, on summed log-probabilities."""

    name = "dpo"
    settings_read = ("beta", "loss_type", "label_smoothing", *REFERENCE_SETTINGS)

    def refusals(self, config: Any) -> list[str]:
        found = super().refusals(config)
        task = config.task
        try:
            DPOSettings(task.loss_type, task.beta, task.label_smoothing)
        except ValueError as error:
            found.append(f"--task dpo: {error} (--loss-type, --beta, --label-smoothing)")
        return found

    def objective(self, model, rows, *, reference_logps=None, **_):
        task = self.config.task
        policy = PairLogprobs.from_rows(self.policy_logprobs(model, rows))
        reference = self.reference_sums(model, rows, reference_logps)
        reference_pairs = PairLogprobs(reference[: rows.pairs], reference[rows.pairs :], policy.chosen_tokens,
                                       policy.rejected_tokens)
        result = dpo_loss(policy, reference_pairs, DPOSettings(task.loss_type, task.beta, task.label_smoothing))
        return result.losses.sum(), result, dict.fromkeys(result.metrics, rows.pairs)


class SimPOTask(PreferenceTask):
    """SimPO: average log-probabilities against a margin, no reference; plus cpo_alpha x the chosen NLL."""

    name = "simpo"
    needs_reference = False
    settings_read = ("beta", "label_smoothing", "simpo_gamma", "cpo_alpha")

    def nll_targets(self, sample: dict) -> int:
        return len(sample["chosen_ids"]) if self.config is not None and self.config.task.cpo_alpha else 0

    def objective(self, model, rows, *, nll_weights=None, **_):
        task = self.config.task
        policy = PairLogprobs.from_rows(self.policy_logprobs(model, rows))
        result = simpo_loss(policy, SimPOSettings(task.beta, task.simpo_gamma, task.label_smoothing, task.cpo_alpha))
        total = result.losses.sum()
        if task.cpo_alpha and nll_weights is not None:
            total = total - task.cpo_alpha * (policy.chosen * nll_weights).sum()
        return total, result, dict.fromkeys(result.metrics, rows.pairs)


class ORPOTask(PreferenceTask):
    """ORPO: the NLL of the chosen rows (prompt included, as TRL) plus beta x the odds-ratio term; no reference."""

    name = "orpo"
    needs_reference = False

    def nll_targets(self, sample: dict) -> int:
        return len(sample["prompt_ids"]) + len(sample["chosen_ids"]) - 1  # every real token but the first is predicted

    def objective(self, model, rows, *, nll_weights=None, **_):
        # one forward scores every real token (the NLL's) and, restricted, the completions' (the odds ratio's)
        whole = self.policy_logprobs(model, rows, labels=rows.every_token_labels(), per_token=True)
        completions = PairLogprobs.from_rows(whole.restricted_to(rows.answer_labels))
        chosen_rows = slice(0, rows.pairs)
        result = orpo_loss(completions, whole.sums[chosen_rows], whole.token_counts[chosen_rows],
                           ORPOSettings(self.config.task.beta))
        weights = nll_weights if nll_weights is not None else rows.pairs / whole.token_counts[chosen_rows].sum()
        total = result.losses.sum() - (whole.sums[chosen_rows] * weights).sum()
        return total, result, dict.fromkeys(result.metrics, rows.pairs)


class KTOTask(PreferenceTask):
    """KTO: each completion's log-ratio against the reference point z (its KL estimate), weighted by its label."""

    name = "kto"
    unit = "completions"
    eval_metrics = ("rewards/margins", "kl")  # no accuracy: a completion is not compared with another (TRL's)
    settings_read = ("beta", "desirable_weight", "undesirable_weight", *REFERENCE_SETTINGS)

    def refusals(self, config: Any) -> list[str]:
        found = super().refusals(config)
        if config.training.batch_size < 2:
            found.append("--task kto estimates its KL term from the other completions of a micro-batch, so it needs"
                         " --batch-size 2 or more (as TRL)")
        return found

    def objective(self, model, rows, *, desirable, reference_logps=None, **_):
        task = self.config.task
        count = rows.pairs
        matched, mismatched = rows.sides()
        policy = self.policy_logprobs(model, matched).sums
        with torch.no_grad():  # z is a detached baseline: its rows need no graph (TRL's no_grad too)
            policy_mismatched = self.policy_logprobs(model, mismatched).sums
        reference = self.reference_sums(model, rows, reference_logps)
        z = kto_kl_estimate(policy_mismatched, reference[count:])
        result = kto_loss(policy, reference[:count], desirable, z,
                          KTOSettings(task.beta, task.desirable_weight, task.undesirable_weight))
        chosen = desirable.to(torch.float32).sum()
        weights: dict[str, Any] = {"kl": count}
        for name in result.metrics:
            if name != "kl":
                weights[name] = chosen if name.endswith("/chosen") else count - chosen
        return result.losses.sum(), result, weights


PREFERENCE_TASK_CLASSES: tuple[type[PreferenceTask], ...] = (DPOTask, SimPOTask, ORPOTask, KTOTask)

"""The preference objectives against TRL 1.16's own loss code: DPO (sigmoid, hinge, ipo, robust), SimPO, ORPO and KTO
give TRL's per-pair losses, batch loss and metrics on random log-probabilities; a 2x error in beta or a missing length
normalisation does not; and a few SGD steps on a tiny Llama with memfit's chunked log-probabilities reach the weights
that the same steps reach through TRL's loss code on the materialized logits.

TRL's trainers compute their losses in methods that read a handful of attributes of the trainer; the tests call those
methods on a namespace that carries just these attributes, so no trainer (dataset, tokenizer, accelerator) is built.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from memfit.tasks.preference_losses import (
    DPO_LOSS_TYPES,
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
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import SequenceLogprobs, sequence_logprobs
from tiny_llama import tiny_llama

PAIRS = 6
PAIRED_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")
SETTINGS = {
    "sigmoid": DPOSettings("sigmoid", beta=0.3),
    "hinge": DPOSettings("hinge", beta=0.3),
    "ipo": DPOSettings("ipo", beta=0.3),
    "robust": DPOSettings("robust", beta=0.3, label_smoothing=0.2),
}
assert tuple(SETTINGS) == DPO_LOSS_TYPES


@pytest.fixture(scope="module")
def trl():
    return pytest.importorskip("trl")


def accelerator() -> types.SimpleNamespace:
    """What TRL's loss code asks of its accelerator in one process: the device, and gathers that return their input."""
    return types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)


def random_pairs(seed: int, pairs: int = PAIRS) -> tuple[PairLogprobs, PairLogprobs]:
    """Policy and reference log-probabilities of `pairs` pairs, completions of 1 to 20 tokens (a tie included)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 21, (2, pairs), generator=generator).float()
    reference = -tokens * (1 + 2 * torch.rand(2, pairs, generator=generator, dtype=torch.float64))
    # a log-probability is negative: ORPO's log(1 - p) is undefined above 0
    policy = torch.minimum(reference + torch.randn(2, pairs, generator=generator, dtype=torch.float64) * 3,
                           -0.05 * tokens)
    policy[:, 0] = reference[:, 0]  # an untrained pair: log-ratios of 0
    return (PairLogprobs(policy[0].float(), policy[1].float(), tokens[0], tokens[1]),
            PairLogprobs(reference[0].float(), reference[1].float(), tokens[0], tokens[1]))


def assert_metrics_match(memfit_metrics: dict[str, torch.Tensor], trl_metrics: dict[str, float], names) -> None:
    for name in names:
        assert memfit_metrics[name].item() == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-6), name


def config_defaults(config_class) -> dict:
    """The defaults of a TRL config's fields, read from the dataclass (building one validates a whole training run)."""
    return {field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
            for field in dataclasses.fields(config_class)
            if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING}


# ---------------------------------------------------------------- DPO


class FixedLogprobs:
    """A stand-in for a model with TRL's fused head: returns given per-token log-probabilities, whatever the input."""

    def __init__(self, per_token: torch.Tensor) -> None:
        self.per_token = per_token

    def __call__(self, **kwargs) -> types.SimpleNamespace:
        zeros = torch.zeros_like(self.per_token)
        return types.SimpleNamespace(log_probs=self.per_token, entropy=zeros, mean_logits=zeros,
                                     is_top1=zeros.bool(), aux_loss=None)


def dpo_trainer(settings: DPOSettings) -> types.SimpleNamespace:
    """The attributes DPOTrainer._compute_loss reads, for one loss type with precomputed reference log-probabilities."""
    return types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=accelerator(), beta=settings.beta,
        loss_types=[settings.loss_type], loss_weights=[1.0], label_smoothing=settings.label_smoothing, ld_alpha=None,
        f_divergence_type="reverse_kl", use_weighting=False, aux_loss_enabled=False, precompute_ref_logps=True,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)


def trl_dpo(policy: PairLogprobs, reference: PairLogprobs, settings: DPOSettings) -> tuple[float, dict[str, float]]:
    """TRL's DPO loss and metrics of these pairs: each row's sum lies on its first scored position, and its completion
    mask has as many tokens as its completion (what IPO's normalisation counts)."""
    from trl import DPOTrainer

    tokens = torch.cat([policy.chosen_tokens, policy.rejected_tokens]).long()
    length = int(tokens.max()) + 2
    positions = torch.arange(length)
    completion_mask = ((positions >= 1) & (positions <= tokens[:, None])).long()
    per_token = torch.zeros(tokens.numel(), length - 1)
    per_token[:, 0] = torch.cat([policy.chosen, policy.rejected])
    inputs = {"input_ids": torch.zeros(tokens.numel(), length, dtype=torch.long),
              "attention_mask": torch.ones(tokens.numel(), length, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": reference.chosen,
              "ref_rejected_logps": reference.rejected}
    trainer = dpo_trainer(settings)
    loss = DPOTrainer._compute_loss(trainer, FixedLogprobs(per_token), inputs, False)
    return loss.item(), {name: values[-1] for name, values in trainer._metrics["train"].items()}


def pair(logprobs: PairLogprobs, index: int) -> PairLogprobs:
    return PairLogprobs(*(getattr(logprobs, name)[index:index + 1] for name in
                          ("chosen", "rejected", "chosen_tokens", "rejected_tokens")))


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_losses_and_metrics_equal_trls(trl, loss_type):
    settings = SETTINGS[loss_type]
    policy, reference = random_pairs(seed=1)
    result = dpo_loss(policy, reference, settings)
    for index in range(PAIRS):  # TRL returns the batch mean only: one pair per call gives each pair's loss
        trl_pair_loss, _ = trl_dpo(pair(policy, index), pair(reference, index), settings)
        assert result.losses[index].item() == pytest.approx(trl_pair_loss, rel=1e-6, abs=1e-6), index
    trl_loss, trl_metrics = trl_dpo(policy, reference, settings)
    assert result.loss.item() == pytest.approx(trl_loss, rel=1e-6, abs=1e-6)
    assert_metrics_match(result.metrics, trl_metrics, PAIRED_METRICS)


def test_dpo_defaults_are_trls(trl):
    config = config_defaults(trl.DPOConfig)
    assert (DPOSettings().loss_type, DPOSettings().beta, DPOSettings().label_smoothing) == (
        *config["loss_type"], config["beta"], config["label_smoothing"])


# ---------------------------------------------------------------- SimPO and ORPO: average log-probabilities


def trainer_with_methods(trainer_class, **attributes) -> types.SimpleNamespace:
    """A namespace with `attributes` whose loss methods are `trainer_class`'s, bound to it."""
    namespace = types.SimpleNamespace(accelerator=accelerator(), is_encoder_decoder=False, aux_loss_enabled=False,
                                      concatenated_inputs=trainer_class.concatenated_inputs,
                                      get_batch_logps=trainer_class.get_batch_logps, **attributes)
    for method in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(trainer_class, method):
            setattr(namespace, method, types.MethodType(getattr(trainer_class, method), namespace))
    return namespace


def cpo_trainer(settings: SimPOSettings) -> types.SimpleNamespace:
    from trl.experimental.cpo import CPOTrainer

    return trainer_with_methods(CPOTrainer, loss_type="simpo", alpha=0.0, beta=settings.beta,
                                simpo_gamma=settings.simpo_gamma, label_smoothing=settings.label_smoothing,
                                cpo_alpha=settings.cpo_alpha, pad_token_id=0)


def orpo_trainer(settings: ORPOSettings) -> types.SimpleNamespace:
    from trl.experimental.orpo import ORPOTrainer

    return trainer_with_methods(ORPOTrainer, beta=settings.beta, padding_value=0)


SIMPO = SimPOSettings(beta=2.0, simpo_gamma=0.8, label_smoothing=0.1, cpo_alpha=0.7)


def test_simpo_losses_equal_cpo_loss_on_average_log_probabilities(trl):
    from trl.experimental.cpo import CPOTrainer

    policy, _ = random_pairs(seed=2)
    result = simpo_loss(policy, SIMPO)
    trl_losses, trl_chosen_rewards, trl_rejected_rewards = CPOTrainer.cpo_loss(
        cpo_trainer(SIMPO), policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens)
    torch.testing.assert_close(result.losses, trl_losses, rtol=1e-6, atol=1e-6)
    assert result.metrics["rewards/chosen"].item() == pytest.approx(trl_chosen_rewards.mean().item(), rel=1e-6)
    assert result.metrics["rewards/rejected"].item() == pytest.approx(trl_rejected_rewards.mean().item(), rel=1e-6)


def test_orpo_losses_equal_the_negated_odds_ratio_loss_on_average_log_probabilities(trl):
    from trl.experimental.orpo import ORPOTrainer

    settings = ORPOSettings(beta=0.25)
    policy, _ = random_pairs(seed=3)
    policy.chosen[1] = -1e-4 * policy.chosen_tokens[1]  # a near-certain completion: log(1 - p) near its singularity
    result = orpo_loss(policy, policy.chosen, policy.chosen_tokens, settings)
    trl_terms, _, _, trl_log_odds_ratio, trl_log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        orpo_trainer(settings), policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens)
    torch.testing.assert_close(result.losses, -trl_terms, rtol=1e-6, atol=1e-6)  # TRL subtracts its terms
    assert result.metrics["log_odds_ratio"].item() == pytest.approx(trl_log_odds_ratio.item(), rel=1e-6)
    assert result.metrics["log_odds_chosen"].item() == pytest.approx(trl_log_odds_chosen.item(), rel=1e-6)


class FixedLogits(torch.nn.Module):
    """A stand-in for a causal LM that returns given logits, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, *args, **kwargs) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.logits)


def logits_batch(seed: int, pairs: int = 4, length: int = 12, vocab: int = 11):
    """Random logits and the TRL batch of `pairs` prompt + completion pairs they score (prompts of 3 to 5 tokens, one
    padded rejected row), with memfit's per-row targets: the completions', and every real token's."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (2 * pairs, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, length - 3:] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    for row in range(2 * pairs):
        labels[row, : 3 + row % 3] = IGNORE_INDEX
    batch = {f"{side}_{name}": tensor[rows] for side, rows in (("chosen", slice(0, pairs)),
                                                               ("rejected", slice(pairs, None)))
             for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels))}
    logits = torch.randn(2 * pairs, length, vocab, generator=generator) * 3
    every_token = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return logits, batch, labels, every_token


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> SequenceLogprobs:
    """What sequence_logprobs computes, the plain way: log-softmax and gather of the next token, per-token kept."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    scored = targets != IGNORE_INDEX
    per_token = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * scored
    return SequenceLogprobs(per_token.sum(-1), scored.sum(-1, dtype=torch.float32), per_token)


def test_simpo_batch_loss_with_its_nll_and_metrics_equal_cpos_from_the_same_logits(trl):
    from trl.experimental.cpo import CPOTrainer

    logits, batch, labels, _ = logits_batch(seed=4)
    result = simpo_loss(PairLogprobs.from_rows(logprobs_from_logits(logits, labels)), SIMPO)
    trl_loss, trl_metrics = CPOTrainer.get_batch_loss_metrics(cpo_trainer(SIMPO), FixedLogits(logits), batch)
    assert result.loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    assert_metrics_match(result.metrics, trl_metrics, (*PAIRED_METRICS, "nll_loss"))


def test_simpo_without_the_nll_term_is_the_mean_of_its_losses(trl):
    from trl.experimental.cpo import CPOTrainer

    settings = SimPOSettings(cpo_alpha=0.0)
    logits, batch, labels, _ = logits_batch(seed=5)
    result = simpo_loss(PairLogprobs.from_rows(logprobs_from_logits(logits, labels)), settings)
    trl_loss, trl_metrics = CPOTrainer.get_batch_loss_metrics(cpo_trainer(settings), FixedLogits(logits), batch)
    assert result.loss.item() == pytest.approx(trl_loss.item(), rel=1e-6) == result.losses.mean().item()
    assert result.metrics["nll_loss"].item() == trl_metrics["nll_loss"] == 0


def test_orpo_batch_loss_with_the_nll_of_whole_chosen_rows_and_metrics_equal_orpos_from_the_same_logits(trl):
    from trl.experimental.orpo import ORPOTrainer

    settings = ORPOSettings(beta=0.3)
    logits, batch, labels, every_token = logits_batch(seed=6)
    whole_rows = logprobs_from_logits(logits, every_token)
    completions = PairLogprobs.from_rows(whole_rows.restricted_to(labels))
    chosen_rows = slice(0, completions.chosen.numel())
    result = orpo_loss(completions, whole_rows.sums[chosen_rows], whole_rows.token_counts[chosen_rows], settings)
    trl_loss, trl_metrics = ORPOTrainer.get_batch_loss_metrics(orpo_trainer(settings), FixedLogits(logits), batch)
    assert result.loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    assert_metrics_match(result.metrics, trl_metrics, (*PAIRED_METRICS, "nll_loss", "log_odds_ratio",
                                                       "log_odds_chosen"))


def test_simpo_and_orpo_defaults_are_trls(trl):
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    cpo = config_defaults(CPOConfig)
    simpo = SimPOSettings()
    assert (simpo.beta, simpo.simpo_gamma, simpo.label_smoothing, simpo.cpo_alpha) == (
        cpo["beta"], cpo["simpo_gamma"], cpo["label_smoothing"], cpo["cpo_alpha"])
    assert ORPOSettings().beta == config_defaults(ORPOConfig)["beta"]


# ---------------------------------------------------------------- KTO


class RowLogprobs:
    """A stand-in for a model with TRL's fused head: row r's per-token log-probabilities are `table[input_ids[r, 0]]`,
    so the matched and the mismatched (KL) rows of a batch get theirs by their first token."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __call__(self, input_ids, **kwargs) -> types.SimpleNamespace:
        per_token = self.table[input_ids[:, 0]]
        zeros = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def kto_trainer(settings: KTOSettings) -> types.SimpleNamespace:
    """The attributes KTOTrainer._compute_loss reads, with the KL term and precomputed reference log-probabilities."""
    from trl import KTOTrainer

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=accelerator(), beta=settings.beta, loss_type="kto",
        desirable_weight=settings.desirable_weight, undesirable_weight=settings.undesirable_weight,
        calculate_KL=True, precompute_ref_logps=True, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    return trainer


def trl_kto(policy, reference, desirable, policy_kl, reference_kl, settings) -> tuple[float, dict[str, float]]:
    """TRL's KTO loss and metrics: each row's sum on its first position; KL rows are told apart by their first token."""
    from trl import KTOTrainer

    examples, length = policy.numel(), 4
    table = torch.zeros(2 * examples, length - 1)
    table[:, 0] = torch.cat([policy, policy_kl])
    ids = torch.arange(examples)[:, None].expand(examples, length).contiguous()
    ones = torch.ones(examples, length, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": ones, "completion_mask": ones, "label": desirable.long(),
             "KL_input_ids": ids + examples, "KL_attention_mask": ones, "KL_completion_mask": ones,
             "ref_logps": reference, "ref_KL_logps": reference_kl}
    trainer = kto_trainer(settings)
    loss = KTOTrainer._compute_loss(trainer, RowLogprobs(table), batch, False)
    return loss.item(), {name: values[-1] for name, values in trainer._metrics["train"].items()}


def random_examples(seed: int, examples: int = 7):
    generator = torch.Generator().manual_seed(seed)
    reference = -20 * torch.rand(examples, generator=generator) - 1
    policy = reference + torch.randn(examples, generator=generator) * 2
    desirable = torch.rand(examples, generator=generator) < 0.5
    desirable[:2] = torch.tensor([True, False])  # both kinds, whatever the draw
    reference_kl = -20 * torch.rand(examples, generator=generator) - 1
    policy_kl = reference_kl + torch.randn(examples, generator=generator) + 0.5
    return policy, reference, desirable, policy_kl, reference_kl


KTO = KTOSettings(beta=0.2, desirable_weight=1.3, undesirable_weight=0.8)
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("shift", [0.0, -30.0], ids=["positive-kl", "negative-kl-clamped"])
def test_kto_losses_and_metrics_equal_trls(trl, shift):
    policy, reference, desirable, policy_kl, reference_kl = random_examples(seed=7)
    policy_kl = policy_kl + shift
    kl = kto_kl_estimate(policy_kl, reference_kl)
    result = kto_loss(policy, reference, desirable, kl, KTO)
    trl_loss, trl_metrics = trl_kto(policy, reference, desirable, policy_kl, reference_kl, KTO)
    assert result.loss.item() == pytest.approx(trl_loss, rel=1e-6, abs=1e-6)
    assert_metrics_match(result.metrics, trl_metrics, KTO_METRICS)
    assert (kl.item() == 0) == (shift < 0)
    # each example alone, its KL row carrying the batch's whole estimate, gives that example's loss
    batch_kl = (policy_kl - reference_kl).mean().reshape(1)
    for index in range(policy.numel()):
        alone = slice(index, index + 1)
        trl_example, _ = trl_kto(policy[alone], reference[alone], desirable[alone], batch_kl, torch.zeros(1), KTO)
        assert result.losses[index].item() == pytest.approx(trl_example, rel=1e-6, abs=1e-6), index


def test_kto_metrics_of_a_batch_with_one_kind_only(trl):
    policy, reference, _, policy_kl, reference_kl = random_examples(seed=8)
    desirable = torch.ones_like(policy, dtype=torch.bool)
    result = kto_loss(policy, reference, desirable, kto_kl_estimate(policy_kl, reference_kl), KTO)
    _, trl_metrics = trl_kto(policy, reference, desirable, policy_kl, reference_kl, KTO)
    assert set(result.metrics) == {"kl", "rewards/chosen", "logps/chosen"}
    assert_metrics_match(result.metrics, trl_metrics, result.metrics)


def test_kto_defaults_are_trls(trl):
    config = config_defaults(trl.KTOConfig)
    settings = KTOSettings()
    assert (settings.beta, settings.desirable_weight, settings.undesirable_weight, "kto") == (
        config["beta"], config["desirable_weight"], config["undesirable_weight"], config["loss_type"])


# ---------------------------------------------------------------- fault twins and settings


def test_a_2x_beta_or_a_missing_length_normalisation_differs_from_trl(trl):
    """The comparisons above can fail: the wrong versions are far from TRL's values."""
    from trl.experimental.cpo import CPOTrainer

    policy, reference = random_pairs(seed=1)
    for loss_type in DPO_LOSS_TYPES:
        settings = SETTINGS[loss_type]
        trl_loss, _ = trl_dpo(policy, reference, settings)
        doubled = dpo_loss(policy, reference, DPOSettings(loss_type, 2 * settings.beta, settings.label_smoothing))
        assert abs(doubled.loss.item() - trl_loss) > 1e-3, loss_type
    unnormalised = PairLogprobs(policy.chosen, policy.rejected, torch.ones(PAIRS), torch.ones(PAIRS))
    trl_ipo, _ = trl_dpo(policy, reference, SETTINGS["ipo"])
    assert abs(dpo_loss(unnormalised, reference, SETTINGS["ipo"]).loss.item() - trl_ipo) > 1e-3

    trl_simpo, _, _ = CPOTrainer.cpo_loss(cpo_trainer(SIMPO), policy.chosen / policy.chosen_tokens,
                                          policy.rejected / policy.rejected_tokens)
    assert (simpo_loss(unnormalised, SIMPO).losses - trl_simpo).abs().max() > 1e-3  # sums, not averages
    assert (simpo_loss(policy, SimPOSettings(2 * SIMPO.beta, SIMPO.simpo_gamma, SIMPO.label_smoothing)).losses
            - trl_simpo).abs().max() > 1e-3

    policy_k, reference_k, desirable, policy_kl, reference_kl = random_examples(seed=7)
    trl_kto_loss, _ = trl_kto(policy_k, reference_k, desirable, policy_kl, reference_kl, KTO)
    doubled_kto = KTOSettings(2 * KTO.beta, KTO.desirable_weight, KTO.undesirable_weight)
    kl = kto_kl_estimate(policy_kl, reference_kl)
    assert abs(kto_loss(policy_k, reference_k, desirable, kl, doubled_kto).loss.item() - trl_kto_loss) > 1e-3
    assert abs(kto_loss(policy_k, reference_k, desirable, 0.0, KTO).loss.item() - trl_kto_loss) > 1e-3  # no KL


@pytest.mark.parametrize("settings, message", [
    (dict(loss_type="kto"), "is not one of"),
    (dict(beta=0.0), "beta must be positive"),
    (dict(loss_type="robust", label_smoothing=0.5), r"\[0, 0.5\)"),
    (dict(loss_type="sigmoid", label_smoothing=0.1), "'robust' only"),
])
def test_dpo_settings_that_trl_would_not_train_as_asked_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DPOSettings(**settings)


# ---------------------------------------------------------------- a few SGD steps on a tiny Llama

LEARNING_RATE = 1.0
STEPS = 3
CHUNK = 8


def pair_rows(pairs: int = 4, vocab: int = 256):
    """Tokens of `pairs` preference pairs, all chosen rows then all rejected ones: prompt + completion, right-padded
    with 0 to one length; labels IGNORE_INDEX on the prompt and the padding."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, vocab, (3 + i,), generator=generator) for i in range(pairs)]
    completions = [torch.randint(1, vocab, (int(n),), generator=generator)
                   for n in torch.randint(2, 9, (2 * pairs,), generator=generator)]
    rows = [torch.cat([prompts[i % pairs], completions[i]]) for i in range(2 * pairs)]
    length = max(len(row) for row in rows)
    input_ids = torch.zeros(2 * pairs, length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = row
        attention_mask[index, : len(row)] = 1
        completion_mask[index, len(prompts[index % pairs]): len(row)] = 1
    labels = input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    return input_ids, attention_mask, completion_mask, labels


class MaterializedLogprobs:
    """A causal LM called as TRL calls its fused head, answered from the materialized logits: every logit, TRL's own
    `selective_log_softmax`, 0 where the label is ignored."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids, attention_mask, labels, **kwargs) -> types.SimpleNamespace:
        from trl.trainer.utils import selective_log_softmax

        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        targets = labels[:, 1:]
        per_token = selective_log_softmax(logits, targets.clamp(min=0)) * (targets != IGNORE_INDEX)
        zeros = torch.zeros_like(per_token).detach()
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def sgd_steps(model: torch.nn.Module, loss_of_step, learning_rate: float = LEARNING_RATE) -> torch.nn.Module:
    """`STEPS` steps of plain SGD (no momentum, no clipping): any error in a gradient shows in the weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_of_step().backward()
        optimizer.step()
    return model


def memfit_rows(model, input_ids, labels, attention_mask, **options) -> SequenceLogprobs:
    return sequence_logprobs(model, input_ids, labels, attention_mask, chunk_size=CHUNK, **options)


def assert_same_weights(memfit_model: torch.nn.Module, trl_model: torch.nn.Module, start: torch.nn.Module) -> None:
    moved = 0.0
    for (name, weight), trl_weight, initial in zip(memfit_model.named_parameters(), trl_model.parameters(),
                                                   start.parameters(), strict=True):
        torch.testing.assert_close(weight, trl_weight, rtol=1e-5, atol=1e-5, msg=name)
        moved = max(moved, (weight - initial).abs().max().item())
    assert moved > 1e-3  # the steps changed the weights well beyond the tolerance


def test_dpo_sigmoid_sgd_steps_with_chunked_logprobs_reach_trls_weights_from_materialized_logits(trl):
    from trl import DPOTrainer

    settings = DPOSettings("sigmoid", beta=0.5)
    input_ids, attention_mask, completion_mask, labels = pair_rows()
    start = tiny_llama()
    reference = copy.deepcopy(start).requires_grad_(False)
    memfit_model, trl_model = copy.deepcopy(start), copy.deepcopy(start)
    with torch.no_grad():
        reference_pairs = PairLogprobs.from_rows(memfit_rows(reference, input_ids, labels, attention_mask))
        trl_reference = MaterializedLogprobs(reference)(input_ids, attention_mask, labels).log_probs.sum(-1).chunk(2)

    def memfit_step() -> torch.Tensor:
        policy = PairLogprobs.from_rows(memfit_rows(memfit_model, input_ids, labels, attention_mask))
        return dpo_loss(policy, reference_pairs, settings).loss

    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
              "ref_chosen_logps": trl_reference[0], "ref_rejected_logps": trl_reference[1]}
    trainer = dpo_trainer(settings)
    sgd_steps(memfit_model, memfit_step)
    sgd_steps(trl_model, lambda: DPOTrainer._compute_loss(trainer, MaterializedLogprobs(trl_model), inputs, False))
    assert_same_weights(memfit_model, trl_model, start)


def test_dpo_ipo_sgd_steps_reach_trls_weights(trl):
    """IPO reads the completions' lengths: the token counts memfit derives from the labels are TRL's. Its squared
    loss has steeper gradients than the others': a smaller step keeps the weights in a sane range."""
    from trl import DPOTrainer

    settings = DPOSettings("ipo", beta=0.5)
    input_ids, attention_mask, completion_mask, labels = pair_rows()
    start = tiny_llama()
    memfit_model, trl_model = copy.deepcopy(start), copy.deepcopy(start)
    with torch.no_grad():
        reference_pairs = PairLogprobs.from_rows(memfit_rows(start, input_ids, labels, attention_mask))
        trl_reference = MaterializedLogprobs(start)(input_ids, attention_mask, labels).log_probs.sum(-1).chunk(2)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
              "ref_chosen_logps": trl_reference[0], "ref_rejected_logps": trl_reference[1]}
    trainer = dpo_trainer(settings)
    sgd_steps(memfit_model, lambda: dpo_loss(PairLogprobs.from_rows(
        memfit_rows(memfit_model, input_ids, labels, attention_mask)), reference_pairs, settings).loss, 0.05)
    sgd_steps(trl_model, lambda: DPOTrainer._compute_loss(trainer, MaterializedLogprobs(trl_model), inputs, False),
              0.05)
    assert_same_weights(memfit_model, trl_model, start)


def trl_pair_batch(input_ids, attention_mask, labels) -> dict[str, torch.Tensor]:
    pairs = input_ids.size(0) // 2
    return {f"{side}_{name}": tensor[rows] for side, rows in (("chosen", slice(0, pairs)),
                                                              ("rejected", slice(pairs, None)))
            for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels))}


def test_simpo_sgd_steps_with_chunked_logprobs_reach_cpos_weights(trl):
    from trl.experimental.cpo import CPOTrainer

    input_ids, attention_mask, _, labels = pair_rows()
    start = tiny_llama()
    memfit_model, trl_model = copy.deepcopy(start), copy.deepcopy(start)
    batch = trl_pair_batch(input_ids, attention_mask, labels)
    trainer = cpo_trainer(SIMPO)
    sgd_steps(memfit_model, lambda: simpo_loss(PairLogprobs.from_rows(
        memfit_rows(memfit_model, input_ids, labels, attention_mask)), SIMPO).loss)
    sgd_steps(trl_model, lambda: CPOTrainer.get_batch_loss_metrics(trainer, trl_model, batch)[0])
    assert_same_weights(memfit_model, trl_model, start)


def test_orpo_sgd_steps_with_chunked_logprobs_reach_orpos_weights(trl):
    from trl.experimental.orpo import ORPOTrainer

    settings = ORPOSettings(beta=0.5)
    input_ids, attention_mask, _, labels = pair_rows()
    every_token = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    start = tiny_llama()
    memfit_model, trl_model = copy.deepcopy(start), copy.deepcopy(start)
    batch = trl_pair_batch(input_ids, attention_mask, labels)
    trainer = orpo_trainer(settings)

    def memfit_step() -> torch.Tensor:
        # one forward over every real token: the NLL's rows, and the completions' sums within them
        rows = memfit_rows(memfit_model, input_ids, every_token, attention_mask, per_token=True)
        chosen = slice(0, input_ids.size(0) // 2)
        completions = PairLogprobs.from_rows(rows.restricted_to(labels))
        return orpo_loss(completions, rows.sums[chosen], rows.token_counts[chosen], settings).loss

    sgd_steps(memfit_model, memfit_step)
    sgd_steps(trl_model, lambda: ORPOTrainer.get_batch_loss_metrics(trainer, trl_model, batch)[0])
    assert_same_weights(memfit_model, trl_model, start)


def test_kto_sgd_steps_with_chunked_logprobs_reach_ktos_weights(trl):
    """Eight unpaired examples (the pairs' rows, chosen ones desirable); the KL rows pair each prompt with the previous
    example's completion, as TRL builds them."""
    from trl import KTOTrainer

    input_ids, attention_mask, completion_mask, labels = pair_rows()
    desirable = torch.arange(input_ids.size(0)) < input_ids.size(0) // 2
    kl_ids, kl_attention, kl_completion = mismatched_rows(input_ids, attention_mask, completion_mask)
    kl_labels = kl_ids.masked_fill(kl_completion == 0, IGNORE_INDEX)
    start = tiny_llama()
    reference = copy.deepcopy(start).requires_grad_(False)
    memfit_model, trl_model = copy.deepcopy(start), copy.deepcopy(start)
    with torch.no_grad():
        reference_logps = memfit_rows(reference, input_ids, labels, attention_mask).sums
        reference_kl = memfit_rows(reference, kl_ids, kl_labels, kl_attention).sums
        trl_reference = MaterializedLogprobs(reference)(input_ids, attention_mask, labels).log_probs.sum(-1)
        trl_reference_kl = MaterializedLogprobs(reference)(kl_ids, kl_attention, kl_labels).log_probs.sum(-1)

    def memfit_step() -> torch.Tensor:
        with torch.no_grad():
            kl = kto_kl_estimate(memfit_rows(memfit_model, kl_ids, kl_labels, kl_attention).sums, reference_kl)
        policy = memfit_rows(memfit_model, input_ids, labels, attention_mask).sums
        return kto_loss(policy, reference_logps, desirable, kl, KTO).loss

    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
             "label": desirable.long(), "KL_input_ids": kl_ids, "KL_attention_mask": kl_attention,
             "KL_completion_mask": kl_completion, "ref_logps": trl_reference, "ref_KL_logps": trl_reference_kl}
    trainer = kto_trainer(KTO)
    sgd_steps(memfit_model, memfit_step)
    sgd_steps(trl_model, lambda: KTOTrainer._compute_loss(trainer, MaterializedLogprobs(trl_model), batch, False))
    assert_same_weights(memfit_model, trl_model, start)


def mismatched_rows(input_ids, attention_mask, completion_mask):
    """Row i: row i's prompt with row i-1's completion (the last row's for row 0), right-padded to one length."""
    rows = input_ids.size(0)
    prompts = [input_ids[i][(attention_mask[i] == 1) & (completion_mask[i] == 0)] for i in range(rows)]
    completions = [input_ids[i][completion_mask[i] == 1] for i in range(rows)]
    pieces = [(prompts[i], completions[i - 1]) for i in range(rows)]
    length = max(len(p) + len(c) for p, c in pieces)
    ids = torch.zeros(rows, length, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, answer) in enumerate(pieces):
        ids[i, : len(prompt) + len(answer)] = torch.cat([prompt, answer])
        attention[i, : len(prompt) + len(answer)] = 1
        completion[i, len(prompt): len(prompt) + len(answer)] = 1
    return ids, attention, completion

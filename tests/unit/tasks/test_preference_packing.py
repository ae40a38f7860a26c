"""Packed preference pairs (tasks/pair_packing.py) against the padded two-row layout.

Packed, a micro-batch's sequences lie end to end in rows as wide as the longest, positions restarting at each, and
the log-probabilities are laid back out in the two-row order. What it must give: the padded layout's loss, metrics
and every gradient (fp32, within 1e-5) for each DPO loss type, SimPO, ORPO and KTO, with the frozen copy, the cached
reference and adapters off, in one forward and under --pair-layout split (each side packed apart); positions that
run on across sequences (no restart) do not. An out-of-memory split of a packed micro-batch halves its pairs, never
a pair, and the halves add up to the whole. Three SGD steps of `memfit train --task dpo --packing samples` end on the
padded run's weights. What runs: padded for --pair-layout shared-prompt and for models that cannot pack (said in the
log and the task's facts), and for a micro-batch of one length (nothing to remove). The saving: the tracked peak of a
DPO step on pairs of mixed lengths.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_pair_layout import EDGE_LENGTHS, VOCAB, _policy_and_task, evaluated, random_pairs, tracked_task_step
from test_preference_task import preference_config, write_pairs

from fault_injection import assert_same_weights, final_weights, largest_update
from memfit.prediction import preference_step as preference_step_module
from memfit.tasks import build_task
from memfit.tasks import pair_packing as packing_module
from memfit.tasks.pair_layout import SHARED_PROMPT, SPLIT, TWO_ROWS, PairLayout
from memfit.tasks.pair_packing import INDEX, POSITIONS, PairPacking, choose_pair_packing
from tiny_llama import tiny_llama

PADDED = PairPacking("off", "off", "test")
PACKED = PairPacking("samples", "samples", "test")
# mixed lengths: an empty prompt, one-token answers, sequences that fit two to a row and some that do not
MIXED_LENGTHS = [*EDGE_LENGTHS, (12, 3, 2), (2, 2, 9)]


def kto_items(pairs: list[dict]) -> list[dict]:
    """KTO items of the pairs: the chosen answer as the completion, the rejected one as the mismatched completion."""
    return [{"prompt_ids": pair["prompt_ids"], "completion_ids": pair["chosen_ids"],
             "kl_completion_ids": pair["rejected_ids"], "desirable": torch.tensor(index % 2 == 0),
             "index": pair["index"], "input_ids": pair["input_ids"],
             **({"reference_logps": pair["reference_logps"]} if "reference_logps" in pair else {})}
            for index, pair in enumerate(pairs)]


def _step(handler, model, samples, packing: PairPacking, layout: str = TWO_ROWS):
    """(loss, gradients, metrics, batch) of one micro-batch's forward and backward."""
    handler.pair_layout = PairLayout(layout, layout, "test")
    handler.pair_packing = packing
    model.zero_grad(set_to_none=True)
    batch = handler.collate(handler.prepare(list(samples), range(len(samples)), 0), pad_token_id=0)
    loss = handler.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 8,
                            **handler.loss_inputs(batch))
    loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()
                 if parameter.grad is not None}
    return loss.detach(), gradients, handler.step_metrics(), batch


def _assert_same(padded, packed):
    loss, gradients, metrics, _ = padded
    packed_loss, packed_gradients, packed_metrics, _ = packed
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-5)
    assert metrics.keys() == packed_metrics.keys()
    for name, value in metrics.items():
        assert packed_metrics[name] == pytest.approx(value, abs=1e-5), name
    assert gradients and max(float(g.abs().max()) for g in gradients.values()) > 1e-2  # not a comparison of zeros
    for name, gradient in gradients.items():
        torch.testing.assert_close(packed_gradients[name], gradient, rtol=0, atol=1e-5, msg=name)


CASES = [("dpo", {"loss_type": loss_type}, TWO_ROWS) for loss_type in ("sigmoid", "hinge", "ipo", "robust")] + [
    ("dpo", {}, SPLIT), ("simpo", {"cpo_alpha": 0.7}, TWO_ROWS), ("simpo", {"cpo_alpha": 0.7}, SPLIT),
    ("orpo", {}, TWO_ROWS), ("orpo", {}, SPLIT), ("kto", {}, TWO_ROWS)]


@pytest.mark.numerics
@pytest.mark.parametrize(("task", "settings", "layout"), CASES,
                         ids=[f"{task}-{settings.get('loss_type', '')}-{layout}" for task, settings, layout in CASES])
def test_packed_pairs_give_the_padded_loss_metrics_and_gradients(tmp_path, task, settings, layout):
    handler, model = _policy_and_task(task, "sdpa", tmp_path)
    for name, value in settings.items():
        setattr(handler.config.task, name, value)
    if settings.get("loss_type") == "robust":
        handler.config.task.label_smoothing = 0.1
    samples = random_pairs(MIXED_LENGTHS)
    samples = kto_items(samples) if task == "kto" else samples
    padded = _step(handler, model, samples, PADDED, layout)
    packed = _step(handler, model, samples, PACKED, layout)
    rows = 2 * len(samples)
    assert padded[3]["input_ids"].shape[0] == rows and packed[3]["input_ids"].shape[0] < rows  # it packed
    _assert_same(padded, packed)


@pytest.mark.numerics
@pytest.mark.parametrize("reference", ["cached", "adapters-off"])
@pytest.mark.parametrize("task", ["dpo", "kto"])
def test_the_cached_and_adapters_off_references_read_the_same_numbers_packed(tmp_path, reference, task):
    handler, model = _policy_and_task(task, "sdpa", tmp_path, reference="none")
    handler.reference_choice = SimpleNamespace(mode=reference)
    if reference == "adapters-off":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    samples = random_pairs(MIXED_LENGTHS, cached=reference == "cached")
    samples = kto_items(samples) if task == "kto" else samples
    _assert_same(_step(handler, model, samples, PADDED), _step(handler, model, samples, PACKED))


def test_positions_that_run_on_across_sequences_fail_the_equality(tmp_path, monkeypatch):
    """The fault twin: packed rows whose positions do not restart at each sequence (transformers then sees one
    sequence a row, and attention crosses from one pair's sequence into the next)."""
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    samples = random_pairs(MIXED_LENGTHS)
    loss, gradients, _, _ = _step(handler, model, samples, PADDED)
    collate = packing_module.collate_packed_pairs

    def running_on(*args, **kwargs):
        batch = collate(*args, **kwargs)
        rows, width = batch[POSITIONS].shape
        return batch | {POSITIONS: torch.arange(width).expand(rows, width).clone()}

    monkeypatch.setattr("memfit.tasks.preference.collate_packed_pairs", running_on)
    faulty_loss, faulty_gradients, _, _ = _step(handler, model, samples, PACKED)
    assert abs(faulty_loss.item() - loss.item()) > 1e-3
    assert max(float((faulty_gradients[name] - gradient).abs().max()) for name, gradient in gradients.items()) > 1e-3


def test_an_out_of_memory_split_halves_the_pairs_and_the_halves_add_up_to_the_whole(tmp_path):
    """The step splits the list of samples before the collate: each half packs its own pairs' two sequences, and
    a pair is never cut in two (the halves' losses and gradients sum to the whole micro-batch's)."""
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    samples = random_pairs(MIXED_LENGTHS)
    whole = _step(handler, model, samples, PACKED)
    halves = [_step(handler, model, part, PACKED) for part in (samples[:4], samples[4:])]
    for part, (_, _, _, batch) in zip((samples[:4], samples[4:]), halves, strict=True):
        assert batch[INDEX].shape[0] == 2 * len(part)  # both sequences of each of its pairs, and no other pair's
        assert batch["pair_index"].tolist() == [int(sample["index"]) for sample in part]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0], rtol=0, atol=1e-5)
    for name, gradient in whole[1].items():
        torch.testing.assert_close(halves[0][1][name] + halves[1][1][name], gradient, rtol=0, atol=1e-5, msg=name)


def test_evaluation_reads_the_same_metrics_packed(tmp_path):
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    samples = random_pairs(MIXED_LENGTHS)
    results = []
    for packing in (PADDED, PACKED):
        handler.pair_packing = packing
        results.append(evaluated(handler, model, samples))
    assert results[1][0] == pytest.approx(results[0][0], abs=1e-5)
    assert results[1][1] == pytest.approx(results[0][1], abs=1e-5)


def test_a_micro_batch_of_one_length_runs_padded_without_a_mask(tmp_path):
    handler, _ = _policy_and_task("dpo", "sdpa", tmp_path)
    handler.pair_packing = PACKED
    batch = handler.collate(random_pairs([(3, 4, 4), (5, 2, 2)]), 0)
    assert POSITIONS not in batch and bool(batch["attention_mask"].all())


@pytest.mark.slow
def test_three_sgd_steps_of_memfit_dpo_reach_the_padded_weights_packed(llama_dir, tmp_path):
    from memfit.train.loop import train

    data = write_pairs(tmp_path / "pairs.jsonl")
    weights, facts = {}, {}
    for packing in ("off", "samples"):
        result = train(preference_config(llama_dir, data, tmp_path / packing, lr=0.1, packing=packing))
        weights[packing], facts[packing] = final_weights(result), result.summary["task"]["packing"]
    assert facts["samples"].startswith("samples (asked for)") and facts["off"].startswith("off (asked for)")
    start = {name: tensor for name, tensor in final_weights(SimpleNamespace(final_dir=llama_dir)).items()
             if name in weights["off"]}
    assert largest_update(start, weights["off"]) > 1e-2  # far beyond the tolerance
    assert_same_weights(weights["off"], weights["samples"])


# ---------------------------------------------------------------- what runs


def test_shared_prompt_runs_padded_and_says_so_in_the_log_and_the_facts(tmp_path, caplog):
    config = preference_config(tmp_path, tmp_path / "unused.jsonl", tmp_path / "out", packing="samples",
                               pair_layout=SHARED_PROMPT)
    handler = build_task(config)
    handler.prepare_model(tiny_llama(vocab=VOCAB), SimpleNamespace(pad_token_id=0))
    lengths = SimpleNamespace(paired=True, segment_lengths=[[40, 8, 8], [30, 6, 9]])
    with caplog.at_level(logging.INFO, logger="memfit"):
        handler._choose_pair_layout(lengths, say=True)
    assert handler.pair_layout.shared and not handler.pair_packing.packed and handler.pair_packing.fell_back
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("memfit: packing off (--pair-layout shared-prompt runs")
    assert handler.facts()["packing"].startswith("off (--pair-layout shared-prompt runs a pair as one row")
    assert handler._packing_facts()["mode"] == "off"
    # auto asks for nothing: padding where the shared prompt runs is what it means there, said without a warning
    assert not choose_pair_packing("auto", None, shared_prompt=True).fell_back


def test_models_that_cannot_pack_run_padded_and_say_why():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1))
    packing = choose_pair_packing("samples", mamba, shared_prompt=False)
    assert not packing.packed and packing.fell_back and "carry state" in packing.reason
    assert choose_pair_packing("auto", tiny_llama(), shared_prompt=False).packed
    assert not choose_pair_packing("off", tiny_llama(), shared_prompt=False).packed


def test_wrapped_is_refused_for_pairs(tmp_path):
    from memfit.errors import UsageError

    with pytest.raises(UsageError, match="packs whole sequences"):
        build_task(preference_config(tmp_path, tmp_path / "unused.jsonl", tmp_path / "out", packing="wrapped"))


# ---------------------------------------------------------------- what it saves


def _tracked_peak(packing: PairPacking, tmp_path: Path, width: int) -> tuple[int, float, tuple[int, int], float]:
    """(tracked peak bytes, loss, rows, seconds of one more) of a DPO step (forward and backward, the cached
    reference) of 8 pairs of mixed lengths on a 4-layer Llama `width` wide under SDPA, fp32 on the CPU."""
    import time

    handler, _ = _policy_and_task("dpo", "sdpa", tmp_path, reference="none")
    model = tiny_llama(vocab=VOCAB, hidden=width, layers=4, attn_implementation="sdpa")
    handler.pair_layout, handler.pair_packing = PairLayout(TWO_ROWS, TWO_ROWS, "test"), packing
    lengths = [(24, 40, 180), (120, 16, 24), (8, 64, 32), (60, 100, 12), (16, 8, 20), (200, 30, 50), (40, 24, 16),
               (10, 90, 70)]
    batch = handler.collate(random_pairs(lengths, cached=True), 0)
    step, loss = tracked_task_step(handler, model, batch)
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()  # printed, not checked: the time of a step depends on the machine's load
    handler.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 0,
                     **handler.loss_inputs(batch)).backward()
    return step.peak_bytes, loss.item(), tuple(batch["input_ids"].shape), time.perf_counter() - started


@pytest.mark.parametrize("width", [128, 512])
def test_packing_pairs_of_mixed_lengths_lowers_the_tracked_peak_of_a_dpo_step(tmp_path, width):
    padded_peak, loss, padded_rows, padded_seconds = _tracked_peak(PADDED, tmp_path, width)
    packed_peak, packed_loss, packed_rows, packed_seconds = _tracked_peak(PACKED, tmp_path, width)
    print(f"DPO step, 8 pairs of mixed lengths, width {width}: padded {padded_rows} {padded_peak / 2**20:.1f} MiB"
          f" {padded_seconds * 1e3:.0f} ms, packed {packed_rows} {packed_peak / 2**20:.1f} MiB"
          f" {packed_seconds * 1e3:.0f} ms ({1 - packed_peak / padded_peak:.0%} less)")
    assert packed_loss == pytest.approx(loss, abs=1e-4)
    # 16 rows of 250 positions against 8 (2,016 tokens); SDPA's block mask is the padded rows' padding mask, halved
    assert packed_rows[0] <= padded_rows[0] // 2 and packed_peak < 0.65 * padded_peak


# ---------------------------------------------------------------- the estimate


ESTIMATE_SHAPES = {"head-bound": dict(hidden=128, layers=2, vocab=4096),
                   "mlp-bound": dict(hidden=64, layers=2, vocab=256, intermediate=512)}
# 4 pairs (prompt, chosen, rejected) whose 8 sequences fill 5 rows of 128 tokens (the longest is 128)
ESTIMATE_LENGTHS = [(60, 68, 20), (30, 40, 90), (10, 20, 12), (40, 8, 50)]
PLAIN_SAMPLE_MAKER = preference_step_module.traced_sample_maker


def _mixed_pairs_maker(task):
    """`traced_sample_maker`'s stand-in: the ESTIMATE_LENGTHS pairs in turn, whatever row it is handed."""
    plain = PLAIN_SAMPLE_MAKER(task)
    pairs = random_pairs(ESTIMATE_LENGTHS, seed=3)
    made = [0]

    def make_sample(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        pair = pairs[made[0] % len(pairs)]
        made[0] += 1
        sample = plain(input_ids)
        return {**sample, **{name: pair[name] for name in ("prompt_ids", "chosen_ids", "rejected_ids", "input_ids")}}

    return make_sample


@pytest.mark.parametrize("shape", list(ESTIMATE_SHAPES))
@pytest.mark.parametrize("task", ["dpo", "simpo"])
def test_the_estimate_of_a_packed_step_is_within_5_percent_of_its_tracked_peak(monkeypatch, shape, task):
    import numpy as np

    import memfit.train.traced  # noqa: F401  (registers the traced step)
    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate, resolve_run
    from memfit.prediction.traced import StepSetup
    from memfit.train.traced import measure_step_with_tracker
    from tiny_llama import tiny_llama_config

    config = load_config(overrides={"seq_len": 128, "batch_size": 4, "task": task, "packing": "samples"})
    hf_config = tiny_llama_config(**ESTIMATE_SHAPES[shape])
    monkeypatch.setattr(preference_step_module, "data_pair_lengths", lambda config, task: np.array(ESTIMATE_LENGTHS))
    monkeypatch.setattr(preference_step_module, "traced_sample_maker", _mixed_pairs_maker)
    result = estimate(config, hf_config=hf_config)
    run = resolve_run(config, hf_config, None)
    setup = StepSetup(4, 128, torch.float32, None, run.attention, run.checkpointing, run.checkpoint_every,
                      run.loss_chunk_size, torch.device("cpu"))
    truth = measure_step_with_tracker(hf_config, config, setup)
    padded = estimate(config.replace(packing="off"), hf_config=hf_config).peak_bytes
    print(f"{shape} {task}: measured {truth / 2**20:.3f} MiB, estimated {result.peak_bytes / 2**20:.3f} MiB"
          f" ({result.peak_bytes / truth - 1:+.2%}, {result.details['peak_phase']}); padded estimate"
          f" {padded / 2**20:.3f} MiB")
    assert result.details["preference"]["packed_rows"] == 5 and result.details.get("packed_mask_bytes", 0) > 0
    assert abs(result.peak_bytes / truth - 1) <= 0.05
    assert padded / truth - 1 > 0.05  # counting the padded rows misses it


def test_memfit_estimate_reads_the_pair_lengths_of_the_dataset(llama_dir, tmp_path):
    from memfit.prediction.estimator import estimate

    config = preference_config(llama_dir, write_pairs(tmp_path / "pairs.jsonl", count=6), tmp_path / "out",
                               packing="samples", seq_len=192)
    facts = estimate(config).details["preference"]
    # the 4 pairs with the most tokens: their 8 sequences (72 to 92 tokens each) share rows of 192, two a row
    assert facts["packed_sequences"] == 8 and facts["packed_rows"] < 8 and "packed: 8 sequences" in facts["layout"]
    assert "packed_rows" not in estimate(config.replace(packing="off")).details["preference"]

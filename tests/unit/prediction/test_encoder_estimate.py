"""Estimates of encoder models (BERT-like, ESM-like, ModernBERT) for every task, against the tracker's peak.

The truth is the tracked peak of memfit's own training step on real tensors (`measure_step_with_tracker`: a
padded micro-batch, its first row at --seq-len and the other shorter), and for a few configurations the tracked
peak of a real `profile` run on a table: the analytical method stays within its 10 % band, the traced one (the
same step on fake tensors, the padded batch's attention masks added as the analytical method counts them) within
0.5 % of the measured step.
"""

from __future__ import annotations

import random

import pytest
import torch

import memfit.train.traced  # noqa: F401  (registers the traced step)
from memfit.config_loading import load_config
from memfit.prediction.encoders import is_encoder, task_head
from memfit.prediction.estimator import ERROR_BAND, estimate, resolve_run
from memfit.prediction.padding_mask import padding_mask
from memfit.prediction.traced import StepSetup
from memfit.train.traced import measure_step_with_tracker
from tiny_encoders import bert_config, dna_tokenizer, esm_config, write_csv

MIB = 1024**2
LABEL_FIELDS = {"token-classification": "tags", "regression": "value"}


def modernbert_config(vocab: int = 4096):
    """3 blocks (global attention in the first, local in the others, window 64), hidden 128, GeGLU intermediate 384."""
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                            num_attention_heads=4, max_position_embeddings=1024, global_attn_every_n_layers=3,
                            local_attention=64, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2,
                            sep_token_id=3, architectures=["ModernBertForMaskedLM"])


def encoder_config(family: str, vocab: int = 10):
    """3 blocks, hidden 128, intermediate 4 x hidden (as the published encoders), `vocab` tokens."""
    if family == "modernbert":
        return modernbert_config(vocab)
    config = (bert_config if family == "bert" else esm_config)(layers=3, hidden=128, max_positions=1024)
    config.intermediate_size, config.vocab_size = 512, vocab
    config.architectures = ["BertForMaskedLM" if family == "bert" else "EsmForMaskedLM"]
    return config


def _measured(hf_config, config) -> int:
    run = resolve_run(config, hf_config, None)
    setup = StepSetup(config.training.batch_size, config.data.seq_len, {4: torch.float32, 2: torch.bfloat16}[run.weight_bytes],
                      torch.bfloat16 if run.autocast else None, run.attention, run.checkpointing, run.checkpoint_every,
                      run.loss_chunk_size, torch.device("cpu"))
    return measure_step_with_tracker(hf_config, config, setup)


def _config(task: str, **changes):
    return load_config(overrides={"task": task, "label_fields": LABEL_FIELDS.get(task, "label"), "num_labels": 3,
                                  "seq_len": 128, "batch_size": 2, **changes})


TASKS = ["sequence-classification", "token-classification", "regression", "masked-lm"]
FAMILIES = [(family, task) for family in ("bert", "esm") for task in TASKS] + [
    ("modernbert", task) for task in ("sequence-classification", "masked-lm")]


@pytest.mark.parametrize(("family", "task"), FAMILIES)
@pytest.mark.parametrize("changes", [{}, {"gradient_checkpointing": "full"}, {"lora_r": 8}],
                         ids=["adamw", "full checkpointing", "lora"])
def test_encoder_estimates_stay_within_their_band_of_the_tracked_step(family, task, changes):
    # ModernBERT with a 4,096-token embedding under a label head: the embedding's gradient, made after every
    # block's, was counted among them (+11.2 % under full checkpointing)
    hf_config = encoder_config(family, vocab=4096 if task == "masked-lm" or family == "modernbert" else 10)
    config = _config(task, **changes)
    if task == "regression":
        config.task.num_labels = 1
    truth = _measured(hf_config, config)
    traced = estimate(config, hf_config=hf_config, method="traced").peak_bytes
    analytical = estimate(config, hf_config=hf_config).peak_bytes
    print(f"{family} {task} {changes}: measured {truth} B, traced {traced} B ({traced / truth - 1:+.2%}), "
          f"analytical {analytical} B ({analytical / truth - 1:+.1%})")
    # the task's own model, loss and batches on fake tensors, counted by the same tracker: exact but for where the
    # padded batch's masks (which a fake mask hides) are alive at the peak
    assert abs(traced / truth - 1) <= 0.005
    assert abs(analytical / truth - 1) <= ERROR_BAND["analytical"]


def test_the_masked_lm_head_is_counted_at_every_position_and_a_label_head_is_not():
    """The vocabulary logits of a masked LM (every position, 4096 tokens) are most of what the head adds;
    a classifier's few logits are nothing, and no loss chunk applies to them."""
    hf_config = encoder_config("esm", vocab=40_000)
    masked = estimate(_config("masked-lm"), hf_config=hf_config)
    classified = estimate(_config("sequence-classification"), hf_config=hf_config)
    assert masked.details["logits_bytes"] > 12 * 2 * 128 * 40_000 * 0.99  # b x s positions, not b x (s - 1)
    assert classified.details["logits_bytes"] < 1024
    assert masked.details["loss_chunk_size"] == 0  # 256 tokens: fewer than one chunk
    assert estimate(_config("sequence-classification", seq_len=1024), hf_config=hf_config).details[
        "loss_chunk_size"] == 0
    assert estimate(_config("masked-lm", seq_len=1024), hf_config=hf_config).details["loss_chunk_size"] > 0
    head = task_head(_config("token-classification"), __import__("memfit.prediction.encoders").prediction.encoders
                     .architecture_for(hf_config))
    assert head.outputs == 3 and head.per_token and not head.tied


def test_esm_has_no_causal_lm_class_and_is_estimated_as_an_encoder():
    hf_config = encoder_config("esm")
    assert is_encoder(hf_config) and not is_encoder(bert_config().__class__(is_decoder=True))
    result = estimate(_config("sequence-classification"), hf_config=hf_config)
    assert result.details["activations_measured_from_model"] and result.peak_bytes > 0


@pytest.fixture(scope="module")
def equal_length_encoder(tmp_path_factory):
    """A saved tiny ESM and a table of sequences that fill --seq-len 128 exactly ([CLS] + 126 bases + [SEP])."""
    from transformers import AutoModelForMaskedLM

    root = tmp_path_factory.mktemp("encoder")
    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(encoder_config("esm")).save_pretrained(root / "esm")
    dna_tokenizer().save_pretrained(root / "esm")
    rng = random.Random(0)
    rows = [{"sequence": "".join(rng.choice("ACGT") for _ in range(126)), "label": "abc"[i % 3], "value": i / 10}
            for i in range(12)]
    return root / "esm", write_csv(root / "equal.csv", rows)


def _profiled_peak(overrides: dict) -> int:
    from memfit.train.profiling import profile_run

    report, _ = profile_run(load_config(overrides=overrides))
    return report.to_dict()["peak_bytes"]


@pytest.mark.parametrize("task", ["sequence-classification", "regression"])
def test_estimate_of_a_saved_encoder_matches_a_real_profiled_run(equal_length_encoder, tmp_path, task):
    model, table = equal_length_encoder
    overrides = dict(model=str(model), dataset=str(table), task=task, label_fields=LABEL_FIELDS.get(task, "label"),
                     seq_len=128, batch_size=2, max_steps=2, output_dir=str(tmp_path / "out"), report=False)
    truth = _profiled_peak(overrides)
    config = load_config(overrides=overrides | ({"num_labels": 3} if task != "regression" else {}))
    analytical = estimate(config).peak_bytes
    traced = estimate(config, method="traced").peak_bytes
    assert abs(analytical / truth - 1) <= ERROR_BAND["analytical"]
    assert abs(traced / truth - 1) <= ERROR_BAND["traced"]


@pytest.fixture(scope="module")
def varied_lengths_table(tmp_path_factory):
    """Rows of 3 to 126 bases, no two alike: every micro-batch of two is padded to its longer row."""
    rng = random.Random(1)
    lengths = [126, 6, 90, 12, 60, 20, 110, 3, 40, 8, 75, 30]
    rows = [{"sequence": "".join(rng.choice("ACGT") for _ in range(length)), "label": "abc"[i % 3]}
            for i, length in enumerate(lengths)]
    return write_csv(tmp_path_factory.mktemp("varied") / "varied.csv", rows)


@pytest.mark.parametrize("changes", [{}, {"gradient_checkpointing": "full"}], ids=["adamw", "full checkpointing"])
def test_a_padded_batch_is_estimated_as_a_real_run_measures_it(equal_length_encoder, varied_lengths_table, tmp_path,
                                                               changes):
    """A run on rows of very different lengths holds the masks padding builds (the 2-D mask, SDPA's additive
    [b, 1, s, s] copy saved in every layer, the boolean one the checkpoints keep) beyond a run on full rows: the
    estimate's padding term is that difference, and the traced estimate, whose fake masks read as all ones, adds it."""
    model, equal = equal_length_encoder
    base = dict(model=str(model), task="sequence-classification", label_fields="label", seq_len=128, batch_size=2,
                max_steps=6, report=False, **changes)  # 6 steps: every row, the 126-base one padding its batch to 128
    padded = _profiled_peak(base | {"dataset": str(varied_lengths_table), "output_dir": str(tmp_path / "padded")})
    full = _profiled_peak(base | {"dataset": str(equal), "output_dir": str(tmp_path / "full")})
    config = load_config(overrides=base | {"dataset": str(varied_lengths_table), "num_labels": 3})
    analytical, traced = estimate(config), estimate(config, method="traced")
    term = analytical.details["padding_mask_bytes"]
    print(f"padded {padded} B, full rows {full} B, padding term {term} B, traced {traced.peak_bytes} B, "
          f"analytical {analytical.peak_bytes} B")
    assert traced.details["padding_mask_bytes"] == term
    assert abs((padded - full) - term) <= 0.05 * term
    assert abs(traced.peak_bytes / padded - 1) <= 0.005  # without the masks: -2.0 % (-1.1 % checkpointed)
    assert abs(analytical.peak_bytes / padded - 1) <= ERROR_BAND["analytical"]


def test_the_padding_term_counts_the_masks_each_attention_builds():
    from types import SimpleNamespace

    from memfit.prediction.activations import Precision
    from tiny_llama import tiny_llama_config

    def mask(hf_config, attention, batch=2, seq=128, checkpointing="off", probed=True):
        run = SimpleNamespace(attention=attention, checkpointing=checkpointing, checkpoint_every=1, weight_bytes=4)
        return padding_mask(hf_config, run, Precision(4, 4), batch, seq, probed).at_peak()

    bert, b, s = encoder_config("bert"), 2, 128
    flat, square = 8 * b * s, b * s * s  # the int64 2-D mask; a [b, 1, s, s] mask's elements
    assert mask(bert, "sdpa", batch=1) == 0  # one row is never padded
    assert mask(tiny_llama_config(), "sdpa") == 0  # a causal LM's windows are not padded rows
    assert mask(bert, "sdpa") == flat + 3 * 4 * square  # SDPA's fp32 additive copy in each of the 3 layers
    assert mask(bert, "sdpa", checkpointing="full") == flat + square + 4 * square  # + the boolean mask, 1 layer
    assert mask(bert, "eager") == flat  # added to the scores, never saved
    assert mask(bert, "eager", checkpointing="full") == flat + 4 * square  # the checkpoints' input
    assert mask(bert, "flash") == flat  # unpadded into one varlen batch
    # ModernBERT's two local layers build their mask padded or not once the sequence reaches their window (32):
    # padding adds the global layer's
    assert mask(modernbert_config(), "sdpa") == flat + 4 * square
    assert mask(modernbert_config(), "sdpa", seq=16) == 8 * b * 16 + 3 * 4 * b * 16 * 16
    # 6 layers, global in the first and the fourth: the probe measures the first and the second (local, mask
    # included) and counts the second for the other five, the fourth among them; padding adds the first's mask to
    # the probed bytes, and both global layers' to a step traced unpadded (a real padded step at b = 2, s = 256
    # holds 2 x 512 KiB + 4 KiB more than the unpadded trace)
    six = modernbert_config()
    six.num_hidden_layers, six.layer_types = 6, ["full_attention", "sliding_attention", "sliding_attention"] * 2
    assert mask(six, "sdpa") == flat + 4 * square
    assert mask(six, "sdpa", probed=False) == flat + 2 * 4 * square


def test_plan_maximize_batch_size_for_an_encoder_stays_under_the_budget_when_run(equal_length_encoder, tmp_path):
    from memfit.prediction.planner import plan, plan_to_overrides

    model, table = equal_length_encoder
    budget = 40 * MIB
    overrides = dict(model=str(model), dataset=str(table), task="sequence-classification", num_labels=3, seq_len=128,
                     batch_size=1, max_steps=2, output_dir=str(tmp_path / "out"), report=False)
    result = plan(load_config(overrides=overrides), budget_bytes=budget, allow="full", maximize="batch-size")
    assert result.plan["batch_size"] >= 2
    planned = plan_to_overrides(result)
    planned["batch_size"] = min(planned["batch_size"], 12)  # the table's 12 rows: one step
    assert _profiled_peak(overrides | planned) <= budget


def test_plan_maximize_seq_len_for_an_encoder_is_capped_by_its_positions():
    from memfit.prediction.planner import MARGIN, plan, plan_to_overrides

    hf_config = encoder_config("bert")
    config = _config("sequence-classification", seq_len=64, batch_size=1)
    longest = plan(config, budget_bytes=64 * MIB, allow="full", maximize="seq-len", hf_config=hf_config)
    assert 64 < longest.plan["seq_len"] <= 1024  # BERT's learned positions
    tighter = plan(config, budget_bytes=24 * MIB, allow="full", maximize="seq-len", hf_config=hf_config)
    assert tighter.plan["seq_len"] < longest.plan["seq_len"] or longest.plan["seq_len"] == 1024
    planned = config.replace(**plan_to_overrides(tighter))
    assert estimate(planned, hf_config=hf_config, budget_bytes=24 * MIB).fits
    twice = planned.replace(seq_len=2 * planned.data.seq_len)
    assert twice.data.seq_len > 1024 or not estimate(twice, hf_config=hf_config, budget_bytes=24 * MIB * (1 - MARGIN)).fits


@pytest.mark.parametrize("preset", ["esm2-650m", "nt-v2-500m", "dnabert-2-117m", "modernbert-base"])
def test_encoder_presets_estimate_offline_for_every_task(preset):
    from memfit.models.presets import find_preset

    if find_preset(preset) is None:
        pytest.skip(f"no preset {preset}")
    results = {task: estimate(load_config(overrides={"model": preset, "task": task, "seq_len": 512, "batch_size": 2,
                                                     "gradient_checkpointing": "full"})) for task in TASKS}
    assert all(result.peak_bytes > 0 for result in results.values())
    # the masked LM's vocabulary logits at every position weigh more than a classifier's few
    assert results["masked-lm"].details["logits_bytes"] > 1000 * results["sequence-classification"].details[
        "logits_bytes"]


def test_estimate_cli_on_an_encoder_preset(capsys):
    from memfit.cli.main import main

    assert main(["estimate", "--model", "esm2-650m", "--task", "sequence-classification", "--seq-len", "1024",
                 "--json"]) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    assert result["peak_bytes"] > 650e6 * 16  # weights, gradients and two AdamW moments in fp32


def test_an_encoder_under_the_causal_lm_task_is_refused_in_one_line():
    from memfit import TrainConfig, estimate
    from memfit.errors import UsageError

    config = TrainConfig()
    config.model.model = "esm2-8m"  # task left at causal-lm: an encoder has no causal-LM head
    with pytest.raises(UsageError, match="encoder .*--task masked-lm"):
        estimate(config)

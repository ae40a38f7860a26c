"""The preference tasks (tasks/preference.py) and their reference (techniques/reference_model.py) in pieces.

Batches: two rows a pair, completions scored, the prompt and the padding not; KTO's mismatched completions rotate
within runs of the batch as TRL's do. The loss is a sum over pairs whose token-mean NLL terms (SimPO, ORPO) are
weighted so that any split into micro-batches gives the same sum, and one micro-batch gives TRL's batch loss. The
step's metrics weigh micro-batches by pairs and count a redone one once. Settings: TRL's names and defaults, --beta
beside --beta1/--beta2, what each objective refuses. Against TRL: three SGD steps of `memfit train --task dpo` reach
the weights that the same steps reach through TRL's DPO loss code on the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fault_injection import SGD_NO_CLIPPING, final_weights, largest_update
from memfit.config_loading import load_config
from memfit.config_sections import DPO_LOSS_TYPES as CONFIG_LOSS_TYPES
from memfit.errors import UsageError
from memfit.tasks import build_task
from memfit.tasks.preference import (
    PreferenceMetrics,
    PreferenceSamples,
    collate_preference,
    kl_partners,
)
from memfit.tasks.preference_losses import (
    DPO_LOSS_TYPES,
    ORPOSettings,
    PairLogprobs,
    SimPOSettings,
    orpo_loss,
    simpo_loss,
)
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.reference_model import cache_key, choose_reference, load_cached, save_cached
from memfit.techniques.sequence_logprobs import sequence_logprobs
from tiny_llama import tiny_llama

PROMPTS = ["Hi?", "Name a colour.", "Two and two?", "Say yes.", "Best pet?", "Sky colour?"]
CHOSEN = ["Hello there!", "Blue.", "Four.", "Yes.", "A cat, calm and clean.", "Blue by day."]
REJECTED = ["Go away.", "Loud.", "Five, or maybe six.", "No.", "Rocks.", "Green."]


def write_pairs(path: Path, count: int = 4, shift: int = 0) -> Path:
    """`count` short conversational pairs (`shift` picks other texts: other data)."""
    records = [{"prompt": [{"role": "user", "content": PROMPTS[(i + shift) % 6]}],
                "chosen": [{"role": "assistant", "content": CHOSEN[(i + shift) % 6]}],
                "rejected": [{"role": "assistant", "content": REJECTED[(i + shift) % 6]}]} for i in range(count)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def preference_config(model_dir, data, out, task: str = "dpo", **extra):
    values = dict(model=str(model_dir), dataset=str(data), chat_template="chatml", task=task, seq_len=96,
                  batch_size=4, max_steps=3, output_dir=str(out), lr=1.0, beta=0.5, report=False, **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


def sample(index: int, prompt: list[int], chosen: list[int], rejected: list[int]) -> dict[str, torch.Tensor]:
    as_tensor = lambda ids: torch.tensor(ids, dtype=torch.long)  # noqa: E731
    return {"prompt_ids": as_tensor(prompt), "chosen_ids": as_tensor(chosen), "rejected_ids": as_tensor(rejected),
            "index": torch.tensor(index), "input_ids": as_tensor(prompt + chosen + prompt + rejected)}


def random_samples(count: int = 4, vocab: int = 256, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(1, vocab, (int(torch.randint(low, high, (1,), generator=generator)),),
                             generator=generator).tolist()

    return [sample(i, ids(2, 6), ids(2, 9), ids(2, 9)) for i in range(count)]


# ---------------------------------------------------------------- batches


def test_a_pair_is_two_rows_chosen_rows_first_scored_on_the_completions_only():
    batch = collate_preference([sample(7, [1, 2], [3, 4, 5], [6]), sample(9, [8], [9], [10, 11])], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [8, 9, 0, 0, 0], [1, 2, 6, 0, 0], [8, 10, 11, 0, 0]]
    ignored = IGNORE_INDEX
    assert batch["labels"].tolist() == [[ignored, ignored, 3, 4, 5], [ignored, 9, ignored, ignored, ignored],
                                        [ignored, ignored, 6, ignored, ignored], [ignored, 10, 11, ignored, ignored]]
    assert batch["attention_mask"].sum(-1).tolist() == [5, 2, 3, 3]
    assert batch["pair_index"].tolist() == [7, 9] and "reference_logps" not in batch


def test_kto_mismatched_completions_rotate_by_one_within_each_run_of_the_batch():
    assert kl_partners(7, 3).tolist() == [2, 0, 1, 5, 3, 4, 6]


def test_kto_samples_carry_the_previous_items_whole_completion_cut_to_the_length(llama_dir, tmp_path):
    from memfit.data.preferences import load_preference_data
    from memfit.models.loader import load_tokenizer

    config = preference_config(llama_dir, write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "out", "kto")
    items = load_preference_data(config.data, load_tokenizer(str(llama_dir), False), task="kto", say=False)
    samples = PreferenceSamples(items, kl_partners(len(items), 4))
    first, last = samples[0], samples[3]
    assert first["kl_completion_ids"].tolist() == last["completion_ids"].tolist()
    assert samples[1]["kl_completion_ids"].tolist() == first["completion_ids"].tolist()
    batch = collate_preference([samples[i] for i in range(4)], 256)
    assert batch["input_ids"].shape[0] == 8 and batch["desirable"].tolist() == [True] * 4  # chosen ones first (TRL)


# ---------------------------------------------------------------- the loss: a sum over pairs, exact across splits


@pytest.mark.parametrize("task", ["simpo", "orpo"])
def test_token_mean_nll_terms_are_exact_across_micro_batches_and_equal_the_batch_loss(llama_dir, tmp_path, task):
    extra = {"cpo_alpha": 0.7} if task == "simpo" else {}
    config = preference_config(llama_dir, tmp_path / "unused.jsonl", tmp_path / "out", task, **extra)
    handler = build_task(config)
    model = tiny_llama(vocab=256)
    samples = handler.prepare(random_samples(), range(4), step=0)

    def loss_of(pieces) -> torch.Tensor:
        batch = handler.collate(pieces, pad_token_id=0)
        return handler.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 8,
                                **handler.loss_inputs(batch))

    whole = loss_of(samples)
    halves = loss_of(samples[:2]) + loss_of(samples[2:])
    torch.testing.assert_close(halves, whole, rtol=1e-6, atol=1e-6)
    # one micro-batch: the sum over its pairs is pairs x TRL's batch loss (preference_losses, checked against TRL)
    batch = collate_preference(samples, 0)
    if task == "simpo":
        rows = sequence_logprobs(model, batch["input_ids"], batch["labels"], batch["attention_mask"])
        expected = simpo_loss(PairLogprobs.from_rows(rows), SimPOSettings(0.5, 0.5, 0.0, 0.7)).loss
    else:
        every = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        rows = sequence_logprobs(model, batch["input_ids"], every, batch["attention_mask"], per_token=True)
        expected = orpo_loss(PairLogprobs.from_rows(rows.restricted_to(batch["labels"])), rows.sums[:4],
                             rows.token_counts[:4], ORPOSettings(0.5)).loss
    torch.testing.assert_close(whole / 4, expected, rtol=1e-6, atol=1e-6)
    # the fault twin: each micro-batch weighting its NLL by its own tokens is not the same sum
    unprepared = [{key: value for key, value in s.items() if key != "nll_weight"} for s in samples]
    split_alone = loss_of(unprepared[:1]) + loss_of(unprepared[1:])
    assert abs(split_alone.item() - whole.item()) > 1e-4


# ---------------------------------------------------------------- metrics


def test_step_metrics_weigh_micro_batches_by_pairs_and_count_a_redone_one_once():
    metrics = PreferenceMetrics()
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")

    def add(pairs, chosen, rejected, accuracy):
        values = dict(zip(names, map(torch.tensor, (chosen, rejected, accuracy, chosen - rejected)), strict=True))
        metrics.add(torch.tensor(pairs), values, dict.fromkeys(names, len(pairs)))

    add([0, 1, 2, 3], 9.0, 9.0, 0.0)  # its backward ran out of memory: redone below in halves
    add([0, 1, 2], 1.0, 0.0, 1.0)
    add([3], 3.0, 1.0, 0.0)
    result = metrics.result()
    assert result == pytest.approx({"rewards/chosen": 1.5, "rewards/rejected": 0.25, "rewards/accuracies": 0.75,
                                    "rewards/margins": 1.25})
    assert list(result)[:4] == ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    assert metrics.result() == {}  # read once, then forgotten


def test_kto_metrics_average_each_side_over_its_own_completions():
    metrics = PreferenceMetrics()
    metrics.add(torch.tensor([0, 1, 2]), {"kl": torch.tensor(0.3), "rewards/chosen": torch.tensor(2.0)},
                {"kl": 3, "rewards/chosen": torch.tensor(3.0)})
    metrics.add(torch.tensor([3, 4]), {"kl": torch.tensor(0.8), "rewards/chosen": torch.tensor(4.0),
                                       "rewards/rejected": torch.tensor(-1.0)},
                {"kl": 2, "rewards/chosen": torch.tensor(1.0), "rewards/rejected": torch.tensor(1.0)})
    result = metrics.result()
    assert result == pytest.approx({"rewards/chosen": 2.5, "rewards/rejected": -1.0, "rewards/margins": 3.5,
                                    "kl": 0.5})


# ---------------------------------------------------------------- settings, references and refusals


def test_flags_carry_trls_names_and_defaults_and_beta_is_not_beta1(trl_configs):
    config = load_config(overrides=[("task", "dpo"), ("beta", "0.3"), ("beta1", "0.8"), ("beta2", "0.9"),
                                    ("loss-type", "ipo")])
    assert (config.task.beta, config.optimizer.beta1, config.optimizer.beta2, config.task.loss_type) == (
        0.3, 0.8, 0.9, "ipo")
    task = load_config(overrides={}).task
    dpo, cpo, kto = trl_configs
    assert CONFIG_LOSS_TYPES == DPO_LOSS_TYPES
    assert ([task.loss_type], task.beta, task.label_smoothing) == (dpo["loss_type"], dpo["beta"], dpo["label_smoothing"])
    assert (task.simpo_gamma, task.cpo_alpha) == (cpo["simpo_gamma"], cpo["cpo_alpha"])
    assert (task.desirable_weight, task.undesirable_weight) == (kto["desirable_weight"], kto["undesirable_weight"])
    assert task.precompute_ref_log_probs == dpo["precompute_ref_log_probs"] is False
    with pytest.raises(UsageError, match="--beta must be positive"):
        load_config(overrides={"beta": 0})


@pytest.fixture(scope="module")
def trl_configs():
    pytest.importorskip("trl")
    from test_preference_losses import config_defaults
    from trl import DPOConfig, KTOConfig
    from trl.experimental.cpo import CPOConfig

    return config_defaults(DPOConfig), config_defaults(CPOConfig), config_defaults(KTOConfig)


@pytest.mark.parametrize("requested, precompute, lora, expected", [
    ("auto", False, True, "adapters-off"), ("auto", False, False, "copy"), ("auto", True, True, "cached"),
    ("cached", False, False, "cached"), ("copy", False, True, "copy"), ("adapters-off", False, True, "adapters-off"),
])
def test_the_reference_is_adapters_off_under_lora_else_a_copy_unless_cached(requested, precompute, lora, expected):
    assert choose_reference(requested, precompute, lora, needs_reference=True).mode == expected
    assert choose_reference(requested, precompute, lora, needs_reference=False).mode == "none"


@pytest.mark.parametrize("task, flags, message", [
    ("dpo", {"reference": "adapters-off"}, "needs LoRA adapters"),
    ("dpo", {"simpo_gamma": 0.3}, "--simpo-gamma does not apply to --task dpo"),
    ("dpo", {"label_smoothing": 0.1}, "'robust' only"),
    ("simpo", {"reference": "copy"}, "--reference does not apply to --task simpo"),
    ("orpo", {"precompute_ref_log_probs": True}, "does not apply to --task orpo"),
    ("kto", {"batch_size": 1}, "--batch-size 2 or more"),
    ("dpo", {"packing": "wrapped"}, "packs whole sequences"),
])
def test_what_an_objective_cannot_honour_is_refused(task, flags, message):
    config = load_config(overrides={"task": task, "dataset": "builtin:preferences"} | flags)
    with pytest.raises(UsageError, match=message):
        build_task(config)


def test_auto_packing_packs_each_micro_batchs_sequences_never_the_samples_into_windows():
    config = load_config(overrides={"task": "dpo", "dataset": "builtin:preferences"})
    task = build_task(config)
    assert config.data.packing == "auto" and task.pair_packing.packed  # tasks/pair_packing.py decides auto
    assert PreferenceSamples.packed_by_task  # techniques/packed_attention.py `pack_for_model` leaves them whole


def test_a_cached_reference_whose_key_differs_is_not_read(tmp_path):
    parts = {"model": "m1", "data": "d1", "settings": {"task": "dpo"}}
    path = tmp_path / "reference.safetensors"
    save_cached(path, torch.ones(3, 2), cache_key("m1", "d1", parts["settings"]), parts)
    values, why = load_cached(path, cache_key("m1", "d1", parts["settings"]), parts)
    assert why == "reused" and values.tolist() == [[1.0, 1.0]] * 3
    other = parts | {"model": "m2"}
    values, why = load_cached(path, cache_key("m2", "d1", other["settings"]), other)
    assert values is None and "the model changed" in why


# ---------------------------------------------------------------- against TRL: three SGD steps


LEARNING_RATE = 0.1


def test_three_sgd_steps_of_memfit_dpo_reach_trls_weights(llama_dir, tmp_path):
    """`memfit train --task dpo` (the frozen-copy reference, chunked log-probabilities, 4 pairs a step) against
    TRL's DPOTrainer._compute_loss on the materialized logits of the same tokens, reference log-probabilities of the
    starting model: SGD without clipping, so a gradient error of any size shows in the weights."""
    pytest.importorskip("trl")
    from test_preference_losses import MaterializedLogprobs, dpo_trainer
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    from memfit.data.preferences import load_preference_data
    from memfit.models.loader import load_tokenizer
    from memfit.tasks.preference_losses import DPOSettings
    from memfit.train.loop import train

    config = preference_config(llama_dir, write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "out", lr=LEARNING_RATE)
    memfit_weights = final_weights(train(config))

    tokenizer = load_tokenizer(str(llama_dir), False)
    items = load_preference_data(config.data, tokenizer, task="dpo", say=False)
    batch = collate_preference([PreferenceSamples(items)[i] for i in range(4)], tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = MaterializedLogprobs(model)(batch["input_ids"], batch["attention_mask"],
                                                batch["labels"]).log_probs.sum(-1).chunk(2)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != IGNORE_INDEX).long(), "ref_chosen_logps": reference[0],
              "ref_rejected_logps": reference[1]}
    trainer = dpo_trainer(DPOSettings("sigmoid", beta=0.5))
    start = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        DPOTrainer._compute_loss(trainer, MaterializedLogprobs(model), inputs, False).backward()
        optimizer.step()
    trl_weights = {name: tensor.detach() for name, tensor in model.state_dict().items() if name in memfit_weights}
    assert trl_weights.keys() == memfit_weights.keys()
    assert largest_update({name: start[name] for name in trl_weights}, trl_weights) > 1e-2  # far beyond the tolerance
    for name, tensor in trl_weights.items():
        torch.testing.assert_close(memfit_weights[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_the_frozen_copy_of_a_traced_model_shares_its_fake_mode_and_survives_garbage_collection():
    """The traced estimate copies a fake model: each copied tensor keeps the trace's mode. Deep-copying the mode
    corrupted the heap (a crash at a later collection), so the check runs in a child process as well."""
    import subprocess
    import sys

    script = (
        "import gc, torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from memfit.techniques.reference_model import frozen_copy\n"
        "from tiny_llama import tiny_llama_config\n"
        "from transformers import AutoModelForCausalLM\n"
        "config = tiny_llama_config(hidden=64, layers=2, vocab=256, intermediate=512)\n"
        "for _ in range(6):\n"
        "    with FakeTensorMode(allow_non_fake_inputs=True) as mode:\n"
        "        model = AutoModelForCausalLM.from_config(config)\n"
        "        copy, copy_bytes = frozen_copy(model)\n"
        "    assert all(t.fake_mode is mode for t in copy.parameters()), 'the copy made a mode of its own'\n"
        "    assert copy is not model and copy_bytes > 0\n"
        "    del model, copy\n"
        "    gc.collect()\n"
        "print('survived')\n"
    )
    tests_dir = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tests_dir, timeout=300)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])

"""A preference pair in one row that computes its prompt once (tasks/pair_layout.py), against two rows a pair.

The row: positions continue from the prompt in each answer's branch, a copy of the prompt's last token predicts the
rejected answer's first, and the 4D mask lets each answer see the prompt and itself only. What it must give: each
answer's log-probabilities, the objectives' losses and every gradient of the two-row layout (fp32, within 1e-5),
under SDPA's boolean mask and eager's additive one, with the frozen copy, the cached reference and adapters off;
a mask that lets the rejected answer see the chosen one does not. Three SGD steps of `memfit train --task dpo` end
on the same weights in both layouts. Which layout runs, and why: auto shares a long prompt where the kernel takes
the mask, and two rows run (said in the log and the facts) for flash-attn, FlexAttention, short prompts, state
that flows across positions, a sliding window shorter than the row, and KTO. The saving: the tracked peak of a DPO
step on pairs with a 192-token prompt and 32-token answers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_preference_task import preference_config, write_pairs

from fault_injection import assert_same_weights, final_weights, largest_update
from memfit.memory.tracker import MemoryTracker
from memfit.tasks import build_task
from memfit.tasks import pair_layout as layouts
from memfit.tasks.pair_layout import (
    ADDITIVE_MASK,
    BOOLEAN_MASK,
    BRANCHES,
    CHOSEN_BRANCH,
    PADDING,
    POSITIONS,
    REJECTED_BRANCH,
    SHARED_PROMPT,
    TRUNK,
    TWO_ROWS,
    PairLayout,
    choose_pair_layout,
    collate_shared_prompt,
    shared_prompt_attention_mask,
)
from memfit.tasks.preference import PreferenceMetrics, collate_preference
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import sequence_logprobs
from tiny_llama import tiny_llama

VOCAB = 256
IGNORED = IGNORE_INDEX
KERNELS = ("sdpa", "eager")
MASK_OF = {"sdpa": BOOLEAN_MASK, "eager": ADDITIVE_MASK}


def pair(index: int, prompt: list[int], chosen: list[int], rejected: list[int], **extra) -> dict[str, torch.Tensor]:
    as_tensor = lambda ids: torch.tensor(ids, dtype=torch.long)  # noqa: E731
    return {"prompt_ids": as_tensor(prompt), "chosen_ids": as_tensor(chosen), "rejected_ids": as_tensor(rejected),
            "index": torch.tensor(index), "input_ids": as_tensor(prompt + chosen + prompt + rejected), **extra}


def random_pairs(lengths: list[tuple[int, int, int]], seed: int = 0, cached: bool = False) -> list[dict]:
    """Pairs of the given (prompt, chosen, rejected) lengths; `cached`: with reference log-probabilities."""
    generator = torch.Generator().manual_seed(seed)
    ids = lambda count: torch.randint(1, VOCAB, (count,), generator=generator).tolist()  # noqa: E731
    extra = lambda index: {"reference_logps": torch.tensor([-40.0 - index, -42.0 + index])} if cached else {}  # noqa: E731
    return [pair(index, ids(p), ids(c), ids(r), **extra(index)) for index, (p, c, r) in enumerate(lengths)]


# an empty prompt, a one-token prompt, answers of one token and of different lengths: every edge of the row
EDGE_LENGTHS = [(5, 3, 4), (1, 2, 6), (0, 4, 2), (9, 1, 1), (3, 6, 6)]


def shared(mask: str) -> PairLayout:
    return PairLayout(SHARED_PROMPT, SHARED_PROMPT, "test", mask)


def two_rows() -> PairLayout:
    return PairLayout(TWO_ROWS, TWO_ROWS, "test")


# ---------------------------------------------------------------- the row


def test_one_row_a_pair_positions_continue_from_the_prompt_in_each_branch():
    batch = collate_shared_prompt([pair(0, [1, 2, 3], [4, 5], [6, 7, 8]), pair(1, [9], [10], [11])], pad_token_id=0)
    # prompt, chosen, the prompt's last token again, rejected
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 3, 6, 7, 8], [9, 10, 9, 11, 0, 0, 0, 0, 0]]
    assert batch[POSITIONS].tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 5], [0, 1, 0, 1, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORED, IGNORED, IGNORED, 4, 5, IGNORED, 6, 7, 8],
                                        [IGNORED, 10, IGNORED, 11] + [IGNORED] * 5]
    trunk, chosen, rejected, pad = TRUNK, CHOSEN_BRANCH, REJECTED_BRANCH, PADDING
    assert batch[BRANCHES].tolist() == [[trunk, trunk, chosen, chosen, chosen, rejected, rejected, rejected, rejected],
                                        [chosen, chosen, rejected, rejected, pad, pad, pad, pad, pad]]
    assert batch["attention_mask"].sum(-1).tolist() == [9, 4]


def test_an_empty_prompt_leaves_each_answers_first_token_unscored_as_two_rows_do():
    batch = collate_shared_prompt([pair(0, [], [4, 5], [6, 7])], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[4, 5, 6, 7]] and batch[POSITIONS].tolist() == [[0, 1, 0, 1]]
    # the chosen answer's last token must not learn to predict the rejected answer's first
    assert batch["labels"].tolist() == [[4, 5, IGNORED, 7]]


def test_each_answer_sees_the_prompt_and_itself_never_the_other():
    batch = collate_shared_prompt([pair(0, [1, 2, 3], [4, 5], [6, 7]), pair(1, [1], [2], [3])], pad_token_id=0)
    visible = shared_prompt_attention_mask(batch[BRANCHES], BOOLEAN_MASK)[:, 0]
    # row 0: trunk 0-1, chosen branch 2-4 (the prompt's last token, chosen), rejected branch 5-7 (its copy, rejected)
    assert visible[0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 0, 0, 0],
                                         [1, 1, 1, 0, 0, 0, 0, 0],
                                         [1, 1, 1, 1, 0, 0, 0, 0],
                                         [1, 1, 1, 1, 1, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 1, 0, 0],
                                         [1, 1, 0, 0, 0, 1, 1, 0],
                                         [1, 1, 0, 0, 0, 1, 1, 1]]
    # padding sees the padding up to itself, nothing else: no query row is empty
    assert torch.equal(visible[1, 4:, 4:], torch.ones(4, 4, dtype=torch.bool).tril()) and not visible[1, 4:, :4].any()
    additive = shared_prompt_attention_mask(batch[BRANCHES], ADDITIVE_MASK, torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and torch.equal(additive == 0, visible[:, None])
    assert (additive[:, 0][~visible] == torch.finfo(torch.bfloat16).min).all()


# ---------------------------------------------------------------- the same numbers as two rows


def _policy_and_task(task: str, kernel: str, config_dir: Path, reference: str = "copy"):
    """A task of `task` and a tiny Llama running `kernel`; with `reference` copy, a frozen copy taken before the
    policy moved away from it (so the log-ratios, and DPO's gradients, are not those of equal models)."""
    config = preference_config(config_dir, config_dir / "unused.jsonl", config_dir / "out", task,
                               **({"cpo_alpha": 0.7} if task == "simpo" else {}))
    handler = build_task(config)
    model = tiny_llama(vocab=VOCAB, attn_implementation=kernel)
    if reference == "copy":
        handler.prepare_model(model, SimpleNamespace(pad_token_id=0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return handler, model


def _loss_and_gradients(handler, model, samples, layout: PairLayout, chunk_size: int = 8):
    handler.pair_layout = layout
    model.zero_grad(set_to_none=True)
    batch = handler.collate(handler.prepare(list(samples), range(len(samples)), 0), pad_token_id=0)
    loss = handler.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), chunk_size,
                            **handler.loss_inputs(batch))
    loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()
                 if parameter.requires_grad}
    return loss.detach(), gradients, handler.step_metrics()


@pytest.mark.numerics
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("task", ["dpo", "simpo", "orpo"])
def test_losses_metrics_and_gradients_equal_the_two_row_layouts(tmp_path, task, kernel):
    handler, model = _policy_and_task(task, kernel, tmp_path)
    samples = random_pairs(EDGE_LENGTHS)
    loss, gradients, metrics = _loss_and_gradients(handler, model, samples, two_rows())
    shared_loss, shared_gradients, shared_metrics = _loss_and_gradients(handler, model, samples, shared(MASK_OF[kernel]))
    torch.testing.assert_close(shared_loss, loss, rtol=0, atol=1e-5)
    assert metrics.keys() == shared_metrics.keys()
    for name, value in metrics.items():
        assert shared_metrics[name] == pytest.approx(value, abs=1e-5), name
    assert max(float(g.abs().max()) for g in gradients.values()) > 1e-2  # the comparison below is not of zeros
    for name, gradient in gradients.items():
        torch.testing.assert_close(shared_gradients[name], gradient, rtol=0, atol=1e-5, msg=name)


@pytest.mark.numerics
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_answers_log_probabilities_equal_the_two_row_layouts(kernel):
    model = tiny_llama(vocab=VOCAB, attn_implementation=kernel)
    samples = random_pairs(EDGE_LENGTHS)
    two = collate_preference(samples, 0)
    expected = sequence_logprobs(model, two["input_ids"], two["labels"], two["attention_mask"], chunk_size=8)
    one = collate_shared_prompt(samples, 0)
    mask = shared_prompt_attention_mask(one[BRANCHES], MASK_OF[kernel])
    scored = sequence_logprobs(model, one["input_ids"], one["labels"], mask, chunk_size=8, position_ids=one[POSITIONS],
                               per_token=True)
    got = layouts.as_two_rows(scored.per_token, one["labels"], one[BRANCHES])
    assert got.token_counts.tolist() == expected.token_counts.tolist()
    torch.testing.assert_close(got.sums, expected.sums, rtol=0, atol=1e-5)


def _leaky_mask(branches: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The deliberate fault: the rejected branch may see the chosen one (as one causal row without a mask would)."""
    as_if_one_branch = branches.masked_fill(branches == REJECTED_BRANCH, CHOSEN_BRANCH)
    return shared_prompt_attention_mask(as_if_one_branch, kind, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_mask_that_lets_the_rejected_answer_see_the_chosen_one_fails_the_equality(tmp_path, monkeypatch, kernel):
    handler, model = _policy_and_task("dpo", kernel, tmp_path)
    samples = random_pairs(EDGE_LENGTHS)
    loss, gradients, _ = _loss_and_gradients(handler, model, samples, two_rows())
    monkeypatch.setattr("memfit.tasks.preference.shared_prompt_attention_mask", _leaky_mask)
    leaky_loss, leaky_gradients, metrics = _loss_and_gradients(handler, model, samples, shared(MASK_OF[kernel]))
    assert abs(leaky_loss.item() - loss.item()) > 1e-3
    assert max(float((leaky_gradients[name] - gradient).abs().max()) for name, gradient in gradients.items()) > 1e-3


@pytest.mark.numerics
@pytest.mark.parametrize("reference", ["cached", "adapters-off"])
def test_the_cached_and_the_adapters_off_references_give_the_same_loss(tmp_path, reference):
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path, reference="none")
    handler.reference_choice = SimpleNamespace(mode=reference)
    if reference == "adapters-off":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    samples = random_pairs(EDGE_LENGTHS, cached=reference == "cached")
    loss, gradients, _ = _loss_and_gradients(handler, model, samples, two_rows())
    shared_loss, shared_gradients, _ = _loss_and_gradients(handler, model, samples, shared(BOOLEAN_MASK))
    torch.testing.assert_close(shared_loss, loss, rtol=0, atol=1e-5)
    assert gradients and max(float(g.abs().max()) for g in gradients.values()) > 1e-3
    for name, gradient in gradients.items():
        torch.testing.assert_close(shared_gradients[name], gradient, rtol=0, atol=1e-5, msg=name)


def evaluated(handler, model: torch.nn.Module, samples: list[dict]) -> tuple[float, dict[str, float]]:
    """(the summed loss, the metrics) of `samples` as one evaluation batch of `handler`."""
    stream = PreferenceMetrics()
    with torch.no_grad():
        total = handler.eval_loss_sum(model, handler.collate(samples, 0), stream)
    return total.item(), stream.result()


def test_evaluation_reads_the_same_metrics_in_either_layout(tmp_path):
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    samples = random_pairs(EDGE_LENGTHS)
    results = []
    for layout in (two_rows(), shared(BOOLEAN_MASK)):
        handler.pair_layout = layout
        results.append(evaluated(handler, model, samples))
    assert results[1][0] == pytest.approx(results[0][0], abs=1e-5)
    assert results[1][1] == pytest.approx(results[0][1], abs=1e-5)


@pytest.mark.slow
def test_three_sgd_steps_of_memfit_dpo_reach_the_same_weights_in_either_layout(llama_dir, tmp_path):
    from memfit.train.loop import train

    data = write_pairs(tmp_path / "pairs.jsonl")
    weights, facts = {}, {}
    for layout in (TWO_ROWS, "auto"):  # the chat template's prompts are longer than the answers: auto shares them
        result = train(preference_config(llama_dir, data, tmp_path / layout, lr=0.1, pair_layout=layout))
        weights[layout], facts[layout] = final_weights(result), result.summary["task"]["pair_layout"]
    assert facts["auto"]["layout"] == SHARED_PROMPT and facts["auto"]["reason"].startswith("auto: the kernel takes")
    assert facts[TWO_ROWS]["layout"] == TWO_ROWS
    start = {name: tensor for name, tensor in final_weights(SimpleNamespace(final_dir=llama_dir)).items()
             if name in weights[TWO_ROWS]}
    assert largest_update(start, weights[TWO_ROWS]) > 1e-2  # far beyond the tolerance
    assert_same_weights(weights[TWO_ROWS], weights["auto"])


# ---------------------------------------------------------------- which layout runs


LONG_PROMPTS = np.array([[192, 32, 40], [150, 20, 30]])
SHORT_PROMPTS = np.array([[10, 32, 40], [12, 20, 30]])


@pytest.mark.parametrize("kernel", KERNELS)
def test_auto_shares_a_long_prompt_where_the_kernel_takes_the_mask(kernel):
    layout = choose_pair_layout("auto", tiny_llama(attn_implementation=kernel), True, LONG_PROMPTS)
    assert layout.layout == SHARED_PROMPT and layout.mask == MASK_OF[kernel]
    assert "prompts average 171 tokens, the shorter answers 26" in layout.reason


def test_auto_runs_two_rows_for_prompts_shorter_than_the_answers_unless_shared_prompt_is_asked_for():
    model = tiny_llama()
    layout = choose_pair_layout("auto", model, True, SHORT_PROMPTS)
    assert layout.layout == TWO_ROWS and "too short a prompt" in layout.reason and not layout.fell_back
    assert choose_pair_layout(SHARED_PROMPT, model, True, SHORT_PROMPTS).layout == SHARED_PROMPT
    assert choose_pair_layout(TWO_ROWS, model, True, LONG_PROMPTS).layout == TWO_ROWS


@pytest.mark.parametrize(("kernel", "why"), [("flash", "flash-attn takes no 4D attention mask"),
                                             ("flex", "dense per-score bias")])
def test_kernels_that_cannot_take_the_mask_run_two_rows_and_say_why(monkeypatch, kernel, why):
    monkeypatch.setattr("memfit.techniques.attention.attention_that_ran", lambda model: kernel)
    layout = choose_pair_layout(SHARED_PROMPT, tiny_llama(), True, LONG_PROMPTS)
    assert layout.layout == TWO_ROWS and why in layout.reason and layout.fell_back


def test_state_that_flows_across_positions_and_a_short_sliding_window_run_two_rows():
    from transformers import MambaConfig, MambaForCausalLM, MistralConfig, MistralForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1))
    layout = choose_pair_layout("auto", mamba, True, LONG_PROMPTS)
    assert layout.layout == TWO_ROWS and "carry state" in layout.reason

    def mistral(window: int):
        return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=window, attn_implementation="sdpa"))

    layout = choose_pair_layout("auto", mistral(128), True, LONG_PROMPTS)  # the longest row: 192 + 32 + 40 + 1
    assert layout.layout == TWO_ROWS and "sliding-window attention (128 tokens)" in layout.reason
    assert choose_pair_layout("auto", mistral(4096), True, LONG_PROMPTS).layout == SHARED_PROMPT


def test_kto_runs_two_rows_and_the_run_says_which_layout_ran(tmp_path, caplog):
    kto = choose_pair_layout(SHARED_PROMPT, tiny_llama(), False, np.array([[20, 5]]))
    assert kto.layout == TWO_ROWS and "kto" in kto.reason and kto.fell_back

    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    handler.requested_pair_layout = SHARED_PROMPT
    monkeypatch = pytest.MonkeyPatch()
    with caplog.at_level(logging.INFO, logger="memfit"):
        handler._choose_pair_layout(SimpleNamespace(paired=True, segment_lengths=LONG_PROMPTS), say=True)
        assert handler.facts()["pair_layout"]["layout"] == SHARED_PROMPT
        assert "one row of its own" in handler.facts()["packing"]
        monkeypatch.setattr("memfit.techniques.attention.attention_that_ran", lambda model: "flash")
        handler._choose_pair_layout(SimpleNamespace(paired=True, segment_lengths=LONG_PROMPTS), say=True)
    monkeypatch.undo()
    facts = handler.facts()
    assert facts["pair_layout"] == {"layout": TWO_ROWS, "requested": SHARED_PROMPT,
                                    "reason": "flash-attn takes no 4D attention mask"}
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == ["memfit: pair layout two-rows (flash-attn takes no 4D attention mask)"]
    batch = handler.collate(random_pairs([(4, 2, 2)]), 0)  # two rows now: nothing of the shared layout
    assert batch["input_ids"].shape[0] == 2 and BRANCHES not in batch


# ---------------------------------------------------------------- what it saves


def _tracked_dpo_step(layout: PairLayout, tmp_path: Path) -> tuple[int, float]:
    """(tracked peak bytes, loss) of a DPO step (forward and backward, the cached reference) of 4 pairs with a
    192-token prompt and 32-token answers on a 4-layer, 128-wide Llama under SDPA, fp32 on the CPU."""
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path, reference="none")
    model = tiny_llama(vocab=VOCAB, hidden=128, layers=4, attn_implementation="sdpa")
    handler.pair_layout = layout
    batch = handler.collate(random_pairs([(192, 32, 32)] * 4, cached=True), 0)
    step, loss = tracked_task_step(handler, model, batch)
    return step.peak_bytes, loss.item()


def tracked_task_step(handler, model: torch.nn.Module, batch: dict):
    """(the tracker's StepMemory, the loss) of one forward and backward of `handler`'s loss on a collated batch."""
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(model)
    try:
        with tracker:
            with tracker.phase("forward"):
                loss = handler.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 0,
                                        **handler.loss_inputs(batch))
            with tracker.phase("backward"):
                loss.backward()
            return tracker.end_step(), loss
    finally:
        tracker.detach()


def test_sharing_a_long_prompt_lowers_the_tracked_peak_of_a_dpo_step(tmp_path):
    two_row_peak, loss = _tracked_dpo_step(two_rows(), tmp_path)
    shared_peak, shared_loss = _tracked_dpo_step(shared(BOOLEAN_MASK), tmp_path)
    print(f"DPO step, 4 pairs, prompt 192, answers 32: two rows {two_row_peak / 2**20:.1f} MiB, shared prompt"
          f" {shared_peak / 2**20:.1f} MiB ({1 - shared_peak / two_row_peak:.0%} less)")
    assert shared_loss == pytest.approx(loss, abs=1e-4)
    # 257 of 448 tokens a pair run (the mask and the repeated keys and values cost some of it back); the weights and
    # their gradients are the same in both
    assert shared_peak < 0.8 * two_row_peak

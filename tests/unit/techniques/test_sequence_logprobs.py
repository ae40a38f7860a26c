"""Completion log-probabilities a chunk at a time: the materialized log-softmax's values and every parameter's
gradient, a peak that grows with the vocabulary by the vocabulary-sized weights and one chunk of logits (not by the
batch's logits), and a fault twin (targets left unshifted) that the comparison catches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit.techniques.sequence_logprobs as logprobs_module
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import SequenceLogprobs, sequence_logprobs
from tiny_llama import tiny_llama

CHUNK = 16  # 3 rows x 40 tokens: chunks that cross rows, and a partial last one
ROW_WEIGHTS = torch.tensor([1.0, -2.0, 0.5])  # a loss that weighs rows apart: a row's sum landing in another shows


def completion_batch(vocab: int = 256, rows: int = 3, length: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels: a prompt of 8 to 12 ignored tokens per row, and padding at the end of one row."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = input_ids.clone()
    for row in range(rows):
        labels[row, : 8 + 2 * row] = IGNORE_INDEX
    labels[0, 30:] = IGNORE_INDEX
    return input_ids, labels


def materialized_logprobs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain computation: every logit of the batch, log-softmax, gather the next token, mask the ignored."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    per_token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * scored).sum(-1)


def sums_and_gradients(model: nn.Module, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    sums = compute()
    (sums * ROW_WEIGHTS).sum().backward()
    return sums.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_matches_materialized(model: nn.Module, **options) -> SequenceLogprobs:
    input_ids, labels = completion_batch(model.config.vocab_size)
    expected_sums, expected = sums_and_gradients(model, lambda: materialized_logprobs(model, input_ids, labels))
    result: list[SequenceLogprobs] = []

    def chunked() -> torch.Tensor:
        result.append(sequence_logprobs(model, input_ids, labels, **options))
        return result[0].sums

    sums, gradients = sums_and_gradients(model, chunked)
    torch.testing.assert_close(sums, expected_sums, rtol=1e-5, atol=1e-5)
    assert gradients.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-5, msg=name)
    return result[0]


def gemma2_like() -> nn.Module:
    """Gemma 2's head in miniature: tied embeddings and tanh soft-capping of the logits (the post-processing the chunks
    apply themselves)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, final_logit_softcapping=2.0,
        attn_implementation="eager"))


@pytest.fixture
def in_place_calls(monkeypatch) -> list[int]:
    """Counts the calls of the in-place head path, so that a test knows which path it compared."""
    calls: list[int] = []
    original = logprobs_module._InPlaceHeadTokenLogprobs.apply

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(logprobs_module._InPlaceHeadTokenLogprobs, "apply", counted)
    return calls


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_in_place_head_sums_and_every_gradient_equal_the_materialized_ones(tied, in_place_calls):
    result = assert_matches_materialized(tiny_llama(tie_word_embeddings=tied), chunk_size=CHUNK)
    assert in_place_calls
    _, labels = completion_batch()
    assert result.token_counts.tolist() == (labels[:, 1:] != IGNORE_INDEX).sum(-1).float().tolist() == [22, 30, 28]
    assert result.sums.dtype == result.token_counts.dtype == torch.float32 and result.per_token is None


def test_soft_capped_logits_are_scored_as_the_models_forward_caps_them(in_place_calls):
    assert_matches_materialized(gemma2_like(), chunk_size=CHUNK)
    assert in_place_calls


def test_a_bf16_model_gets_fp32_sums_close_to_the_materialized_ones():
    model = tiny_llama().to(torch.bfloat16)
    input_ids, labels = completion_batch()
    result = sequence_logprobs(model, input_ids, labels, chunk_size=CHUNK)
    result.sums.sum().backward()
    assert result.sums.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(result.sums, materialized_logprobs(model, input_ids, labels), rtol=1e-3, atol=0)


def test_checkpointed_chunks_and_the_materialized_path_equal_the_materialized_ones(in_place_calls):
    model = tiny_llama()
    assert_matches_materialized(model, chunk_size=CHUNK, in_place_head=False)
    assert_matches_materialized(model, chunk_size=0)
    assert not in_place_calls


def test_a_frozen_head_takes_the_checkpointed_chunks_and_the_rest_still_matches(in_place_calls):
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    assert_matches_materialized(model, chunk_size=CHUNK)
    assert not in_place_calls


def test_per_token_values_means_and_a_restriction_to_fewer_targets():
    model = tiny_llama()
    input_ids, labels = completion_batch()
    whole = labels.clone()
    whole[:, :] = input_ids  # every token a target
    with torch.no_grad():  # a reference model's call: no graph, the chunks simply run
        everything = sequence_logprobs(model, input_ids, whole, chunk_size=CHUNK, per_token=True)
        completion = sequence_logprobs(model, input_ids, labels, chunk_size=CHUNK, per_token=True)
        logits = model(input_ids=input_ids).logits.float()
    expected = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(everything.per_token[:, :-1], expected, rtol=1e-5, atol=1e-6)
    assert (everything.per_token[:, -1] == 0).all()  # the last position predicts nothing
    assert everything.token_counts.tolist() == [39.0] * 3

    restricted = everything.restricted_to(labels)
    torch.testing.assert_close(restricted.sums, completion.sums, rtol=1e-6, atol=1e-5)
    assert torch.equal(restricted.token_counts, completion.token_counts)
    torch.testing.assert_close(completion.means, completion.sums / completion.token_counts)
    with pytest.raises(ValueError, match="per_token=True"):
        SequenceLogprobs(completion.sums, completion.token_counts).restricted_to(labels)


def test_an_unshifted_target_fails_the_comparison(monkeypatch):
    """Fault twin: scoring labels[t] at position t (the shift forgotten) is caught by the equality test."""
    monkeypatch.setattr(logprobs_module, "_shifted_targets", lambda labels: labels)
    with pytest.raises(AssertionError):
        assert_matches_materialized(tiny_llama(), chunk_size=CHUNK)


# ---------------------------------------------------------------- memory

TOKENS = 2 * 256
SMALL_VOCAB, LARGE_VOCAB = 32_768, 131_072
PEAK_CHUNK = 16
MIB = 2**20


def tracked_peak(vocab: int, chunk_size: int):
    """The tracked peak (StepMemory) of one forward and backward of the summed log-probabilities, 2 rows x 256 tokens."""
    from memfit.memory.tracker import MemoryTracker

    model = tiny_llama(vocab=vocab, max_positions=256)
    input_ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[:, :64] = IGNORE_INDEX  # a 64-token prompt
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    try:
        with tracker:
            with tracker.phase("forward"):
                if chunk_size:
                    sums = sequence_logprobs(model, input_ids, labels, chunk_size=chunk_size).sums
                else:
                    sums = materialized_logprobs(model, input_ids, labels)
            with tracker.phase("backward"):
                sums.sum().backward()
                del sums
            return tracker.end_step()
    finally:
        tracker.detach()


@pytest.mark.slow
def test_the_peak_grows_with_the_vocabulary_by_its_weights_not_by_the_logits():
    """A 32K and a 128K head on a 64-wide, 2-layer model: going from one to the other adds 2 x 98304 x 64 x 4 bytes of
    embedding and head weights (48 MiB) and up to one of their gradients (24 MiB) to either peak. The batch's fp32
    logits grow by 512 tokens x 98304 x 4 bytes = 192 MiB per copy: the materialized computation holds several
    copies (the logits, the log-softmax it saves, their gradients); the chunked one holds a 16-token chunk's."""
    vocab_growth = LARGE_VOCAB - SMALL_VOCAB
    weights_growth = 2 * vocab_growth * 64 * 4  # embedding and head
    logits_copy_growth = TOKENS * vocab_growth * 4
    chunk_copy_growth = PEAK_CHUNK * vocab_growth * 4
    chunked = tracked_peak(SMALL_VOCAB, PEAK_CHUNK), tracked_peak(LARGE_VOCAB, PEAK_CHUNK)
    materialized = tracked_peak(SMALL_VOCAB, 0), tracked_peak(LARGE_VOCAB, 0)
    chunked_growth = chunked[1].peak_bytes - chunked[0].peak_bytes
    materialized_growth = materialized[1].peak_bytes - materialized[0].peak_bytes
    print(f"peak MiB: chunked {chunked[0].peak_bytes / MIB:.1f} -> {chunked[1].peak_bytes / MIB:.1f} "
          f"(+{chunked_growth / MIB:.1f}), materialized {materialized[0].peak_bytes / MIB:.1f} -> "
          f"{materialized[1].peak_bytes / MIB:.1f} (+{materialized_growth / MIB:.1f})")

    assert chunked[1].breakdown["parameters"] - chunked[0].breakdown["parameters"] == weights_growth
    # the weights, at most one of their gradients, and a few copies of one chunk's logits
    assert chunked_growth <= 1.5 * weights_growth + 6 * chunk_copy_growth, chunked_growth / MIB
    assert chunked_growth < logits_copy_growth  # not even one copy of the batch's logits
    assert materialized_growth >= weights_growth + 2 * logits_copy_growth, materialized_growth / MIB


def test_the_default_chunk_makes_its_logits_about_the_size_of_the_hidden_states():
    from memfit.techniques.sequence_logprobs import SMALLEST_CHUNK_TOKENS, logprob_chunk_tokens

    # Llama-3.1-8B: 4,096 wide, 128,256 entries (32 a hidden unit); 8 rows of 2,048 tokens -> 512-token chunks
    assert logprob_chunk_tokens(128_256, 4096, 8 * 2048) == 512
    assert logprob_chunk_tokens(128_256, 4096, 1 << 20) == 1024  # never above the chunked loss's default
    assert logprob_chunk_tokens(32_000, 384, 768) == SMALLEST_CHUNK_TOKENS  # 768 / 84 -> 16, raised to the floor
    assert logprob_chunk_tokens(32_000, 384, 16384) == 256  # 16384 / 84 = 195 -> 256
    assert logprob_chunk_tokens(32_000, 384, 4096, chosen=300) == 300  # --loss-chunk-size wins


def test_the_default_chunk_holds_less_than_the_chunked_losss_1024_tokens():
    """512 tokens of a 32K vocabulary, 64 wide: the rule's 64-token chunks against one 1,024-token chunk (the whole
    batch). The difference is at least two fp32 copies of the batch's logits less a few of a chunk's."""
    from memfit.techniques.sequence_logprobs import logprob_chunk_tokens

    chunk = logprob_chunk_tokens(SMALL_VOCAB, 64, TOKENS)
    assert chunk == 64
    by_rule, whole = tracked_peak(SMALL_VOCAB, chunk), tracked_peak(SMALL_VOCAB, 1024)
    logits_copy = TOKENS * SMALL_VOCAB * 4
    assert whole.peak_bytes - by_rule.peak_bytes >= 2 * logits_copy - 6 * chunk * SMALL_VOCAB * 4, (
        (whole.peak_bytes - by_rule.peak_bytes) / MIB)


@pytest.mark.parametrize("grad", [True, False], ids=["policy", "reference"])
def test_only_the_scored_positions_reach_the_head(grad):
    """The prompt, padding and each row's last position are scored 0: the head's matrix product skips them, and the
    values (and, for the policy, the gradients: the other tests here) are those of every position."""
    model = tiny_llama(seed=3)
    input_ids, labels = completion_batch(model.config.vocab_size)
    rows_seen: list[int] = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: rows_seen.append(args[0].shape[0]))
    try:
        with torch.set_grad_enabled(grad):
            values = sequence_logprobs(model, input_ids, labels, chunk_size=16, per_token=True, in_place_head=False)
    finally:
        handle.remove()
    scored = int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert sum(rows_seen) == scored
    assert scored < input_ids.numel()
    torch.testing.assert_close(values.sums.detach(), materialized_logprobs(model, input_ids, labels).detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["policy", "reference"])
def test_temperature_and_entropy_are_trls(grad):
    """GRPO scores completions at their sampling temperature and logs the entropy of each scored position: the
    values of TRL's own `selective_log_softmax` and `entropy_from_logits` on the logits divided by the temperature.
    Leaving the temperature out, or the entropy's positions misplaced, fails."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = tiny_llama(seed=4)
    input_ids, labels = completion_batch(model.config.vocab_size)
    temperature = 0.7
    with torch.set_grad_enabled(grad):
        scored = sequence_logprobs(model, input_ids, labels, chunk_size=16, per_token=True, temperature=temperature,
                                   entropy=True)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float() / temperature
    targets = labels[:, 1:]
    kept = targets != IGNORE_INDEX
    expected = trl_utils.selective_log_softmax(logits[:, :-1], targets.clamp(min=0)) * kept
    expected_entropy = trl_utils.entropy_from_logits(logits[:, :-1]) * kept
    torch.testing.assert_close(scored.per_token[:, :-1].detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored.entropy[:, :-1], expected_entropy, rtol=1e-5, atol=1e-5)
    assert not scored.entropy.requires_grad and bool((scored.entropy[:, -1] == 0).all())

"""The chunked loss with the head's gradient accumulated in place: the plain loss's loss and gradients, one head-sized
gradient instead of the checkpointed chunks' three, and the same update under --optimizer-in-backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit.techniques.chunked_head_loss as head_module
import memfit.techniques.loss as loss_module
from memfit.techniques.chunked_head_loss import chunked_head_loss_sum, in_place_head_problem
from memfit.techniques.loss import IGNORE_INDEX, causal_lm_loss_sum, logit_postprocessing, token_loss_sum
from tiny_llama import tiny_llama

CHUNK = 16  # 3 rows x 40 tokens: 7 full chunks and a partial last one


def batch(vocab: int, rows: int = 3, seq: int = 40):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels = input_ids.clone()
    labels[0, 25:] = IGNORE_INDEX  # padding at the end of one row
    labels[1, :7] = IGNORE_INDEX  # context without loss at the start of another
    return input_ids, labels


def biased_llama() -> nn.Module:
    model = tiny_llama()
    torch.manual_seed(1)
    model.lm_head = nn.Linear(64, 256, bias=True)
    return model


def gemma2_like() -> nn.Module:
    """Gemma 2's shape in miniature: tied embeddings and tanh soft-capping of the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, final_logit_softcapping=2.0,
        attn_implementation="eager"))


MODELS = {"untied": tiny_llama, "tied": lambda: tiny_llama(tie_word_embeddings=True), "bias": biased_llama,
          "gemma2-softcap": gemma2_like}


def loss_and_grads(model: nn.Module, chunk_size: int, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss_sum(model, *batch(model.config.vocab_size), chunk_size=chunk_size, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_error(model: nn.Module, **kwargs) -> tuple[float, dict[str, float]]:
    """(loss's relative error, each gradient's) of the chunked loss against the plain one."""
    plain_loss, plain = loss_and_grads(model, 0)
    chunked_loss, chunked = loss_and_grads(model, CHUNK, **kwargs)
    assert chunked.keys() == plain.keys()
    return (abs(chunked_loss / plain_loss - 1).item(),
            {name: ((chunked[name] - grad).norm() / grad.norm()).item() for name, grad in plain.items()})


@pytest.fixture
def in_place_calls(monkeypatch) -> list[int]:
    """Counts the loss's calls of the in-place path (so a test knows which path it compared)."""
    calls: list[int] = []
    original = loss_module.chunked_head_loss_sum

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loss_module, "chunked_head_loss_sum", counted)
    return calls


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_every_gradient_equal_the_plain_loss(name, in_place_calls):
    model = MODELS[name]()
    assert in_place_head_problem(model.get_output_embeddings(), model) == ""
    loss_error, errors = worst_error(model)
    assert in_place_calls  # the in-place path ran
    assert loss_error < 1e-6
    assert max(errors.values()) < 1e-5, errors  # the embedding's and the blocks' carry the hidden-state gradient


def test_the_functions_hidden_state_head_and_bias_gradients_equal_the_plain_ones():
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=True)
    hidden = torch.randn(50, 32, requires_grad=True)
    targets = torch.randint(0, 300, (50,))
    targets[5:12] = IGNORE_INDEX
    postprocess = logit_postprocessing(type("Config", (), {"final_logit_softcapping": 3.0})())

    plain = token_loss_sum(head(hidden), targets, postprocess)
    expected = torch.autograd.grad(plain, [hidden, head.weight, head.bias])
    chunked = chunked_head_loss_sum(hidden, targets, head, 8, postprocess, token_loss_sum)
    actual = torch.autograd.grad(chunked, [hidden, head.weight, head.bias])
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_last_chunk_added_twice_fails_the_comparison(monkeypatch, in_place_calls):
    """Fault twin: the equality test catches one chunk's head gradient counted twice."""
    original = head_module.accumulate_head_product

    def twice_for_the_partial_chunk(total, grad_logits, rows, dtype):
        total = original(total, grad_logits, rows, dtype)
        return original(total, grad_logits, rows, dtype) if rows.size(0) < CHUNK else total

    monkeypatch.setattr(head_module, "accumulate_head_product", twice_for_the_partial_chunk)
    _, errors = worst_error(tiny_llama())
    assert in_place_calls
    assert errors["lm_head.weight"] > 0.05, errors
    assert errors["model.embed_tokens.weight"] < 1e-5  # only the head's gradient is wrong


def test_under_autocast_an_fp32_head_gets_an_fp32_gradient_close_to_the_plain_one(in_place_calls):
    model = tiny_llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_loss, plain = loss_and_grads(model, 0)
        chunked_loss, chunked = loss_and_grads(model, CHUNK)
    assert in_place_calls and chunked["lm_head.weight"].dtype == torch.float32
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=2e-3, atol=0)
    for name, grad in plain.items():
        # the plain path multiplies in bf16; this one adds each chunk's bf16 operands' product in fp32
        assert (chunked[name] - grad).norm() / grad.norm() < 2e-2, name


def test_a_bf16_head_accumulates_in_bf16_without_another_head_sized_tensor(in_place_calls):
    model = tiny_llama().to(torch.bfloat16)
    plain_loss, plain = loss_and_grads(model, 0)
    chunked_loss, chunked = loss_and_grads(model, CHUNK)
    assert in_place_calls and chunked["lm_head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-2, atol=0)
    assert (chunked["lm_head.weight"] - plain["lm_head.weight"]).float().norm() / plain[
        "lm_head.weight"].float().norm() < 2e-2


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sgd_in_backward_gives_the_plain_losss_update_and_the_head_hook_fires_once(tied, in_place_calls):
    """SGD without clipping: a 2x or a missing chunk in the head's gradient moves the weights visibly."""
    from memfit.techniques.optimizer_in_backward import OptimizerInBackward

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5)

    reference, stepped_in_backward = tiny_llama(tie_word_embeddings=tied), tiny_llama(tie_word_embeddings=tied)
    normal = sgd(reference.parameters())
    causal_lm_loss_sum(reference, *batch(256), chunk_size=0).backward()
    normal.step()

    head_weight = stepped_in_backward.lm_head.weight
    hook_calls: list[torch.Size] = []
    head_weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(p.grad.shape))
    OptimizerInBackward(stepped_in_backward.parameters(), sgd)  # its hooks registered after the counter's
    causal_lm_loss_sum(stepped_in_backward, *batch(256), chunk_size=CHUNK).backward()

    assert in_place_calls and hook_calls == [head_weight.shape]  # once, with the whole gradient
    for (name, expected), actual in zip(reference.named_parameters(), stepped_in_backward.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
        assert actual.grad is None  # freed by the in-backward step


def test_the_checkpointed_chunks_still_run_and_equal_the_plain_loss_where_asked(in_place_calls):
    model = tiny_llama()
    loss_error, errors = worst_error(model, in_place_head=False)
    assert not in_place_calls and loss_error < 1e-6 and max(errors.values()) < 1e-5


def test_a_head_that_is_no_plain_trained_linear_keeps_the_checkpointed_chunks(in_place_calls):
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    assert in_place_head_problem(model.lm_head) == "the output head's weight does not train"
    assert "not a plain Linear" in in_place_head_problem(nn.Bilinear(2, 2, 2))
    loss_and_grads(model, CHUNK)
    assert not in_place_calls


def test_lora_wrapped_head_keeps_the_checkpointed_chunks(in_place_calls):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert "not a plain Linear" in in_place_head_problem(model.get_output_embeddings())
    loss_and_grads(model, CHUNK)
    assert not in_place_calls


def _backward_peak(model: nn.Module, in_place: bool) -> tuple[int, int]:
    """The tracked peak of one forward and backward, and how many head-sized gradients it holds."""
    from memfit.memory.tracker import MemoryTracker

    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with tracker:
        with tracker.phase("forward"):
            loss = causal_lm_loss_sum(model, input_ids, input_ids, chunk_size=16, in_place_head=in_place)
        with tracker.phase("backward"):
            loss.backward()
            del loss
    tracker.detach()
    head_shape = tuple(model.lm_head.weight.shape)
    heads = [t for t in tracker.peak_snapshot().top_tensors if t.shape == head_shape and t.category != "parameters"]
    return tracker.peak_bytes, len(heads)


def test_the_tracker_sees_one_head_sized_gradient_where_the_checkpointed_chunks_hold_two():
    """A head of 8192 x 64 (2 MiB in fp32) dwarfs the rest of a 64-token step. The checkpointed chunks peak with the
    sum so far and the chunk's own head gradient (and the new sum right after); the in-place path holds one. The
    embedding is frozen: its gradient, as large as the head's and made at the very end of backward, would otherwise
    be the in-place path's peak."""
    model = tiny_llama(vocab=8192, layers=1)
    model.model.embed_tokens.weight.requires_grad_(False)
    head = model.lm_head.weight.numel() * 4
    (checkpointed, checkpointed_heads), (in_place, in_place_heads) = _backward_peak(model, False), _backward_peak(
        model, True)
    assert (checkpointed_heads, in_place_heads) == (2, 1)
    assert 0.75 * head < checkpointed - in_place < 1.25 * head, (checkpointed, in_place, head)


def test_the_run_names_its_head_gradient_path_and_a_fallback_says_why():
    from memfit.techniques.chunked_head_loss import head_gradient_path

    fallbacks: dict[str, str] = {}
    assert head_gradient_path(tiny_llama(), "single", CHUNK, False, fallbacks) == "in place" and not fallbacks
    assert head_gradient_path(tiny_llama(), "single", 0, False, fallbacks) == ""  # no chunked loss
    assert head_gradient_path(tiny_llama(), "single", CHUNK, True, fallbacks) == ""  # liger's fused loss
    assert head_gradient_path(tiny_llama(), "deepspeed", CHUNK, False, fallbacks) == "per chunk"
    assert fallbacks["chunked_head_loss"].startswith("DeepSpeed reduces the head's gradient")


def test_training_records_the_in_place_head_gradient_in_the_metrics(llama_dir, text_file, tmp_path):
    from memfit.config_loading import load_config
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics

    run = train(load_config(overrides={"model": str(llama_dir), "dataset": str(text_file), "seq_len": 64,
                                       "batch_size": 2, "loss_chunk_size": 16, "max_steps": 1,
                                       "output_dir": str(tmp_path / "run"), "report": False}))
    facts = [r for r in read_metrics(run.output_dir / "metrics.jsonl") if "loss_head_gradient" in r]
    assert facts and facts[0]["loss_head_gradient"] == "in place"
    assert "chunked_head_loss" not in facts[0]["fallbacks"]

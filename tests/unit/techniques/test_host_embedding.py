"""The frozen input embedding kept in host memory (--embedding-on-host).

Memory: under LoRA the tracked device peak of a step drops by exactly the embedding's bytes, which the tracker
files as host bytes instead, and the estimate moves the same bytes from the device's parameters to the host.
Numerics: the loss and every adapter gradient equal the plain run's; a twin whose host lookup reads the row
after each token's fails. Refusals: a trained embedding, a tied one, a subclass with its own forward.
"""

from __future__ import annotations

import pytest
import torch

from memfit.config import LoraConfig, TrainConfig
from memfit.errors import UsageError
from memfit.techniques import host_embedding
from memfit.techniques.host_embedding import embedding_on_host, embedding_to_host
from model_zoo import ZOO, build_model, randomize_adapters
from tracked_step import tracked_step

pytest.importorskip("peft")


def _lora(family: str):
    from memfit.techniques.lora import apply_lora

    model, _ = apply_lora(build_model(family), LoraConfig(lora_r=2), gradient_checkpointing=False)
    randomize_adapters(model)
    return model


def _tokens():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=_tokens(), labels=_tokens()).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_as_plain(family: str) -> bool:
    model = _lora(family)
    expected_loss, expected = _loss_and_grads(model)
    assert embedding_to_host(model).startswith("input embedding (257, 32) in host memory")
    assert embedding_on_host(model)
    loss, grads = _loss_and_grads(model)
    assert set(grads) == set(expected) and all("lora_" in name for name in grads)
    return loss == expected_loss and all(torch.equal(grads[name], grad) for name, grad in expected.items())


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_the_host_lookup_gives_the_plain_loss_and_adapter_gradients(family):
    assert _same_as_plain(family)


def test_fault_twin_a_lookup_of_the_wrong_rows_is_caught(monkeypatch):
    real = host_embedding._host_forward
    monkeypatch.setattr(host_embedding, "_host_forward",
                        lambda self, ids: real(self, (ids + 1) % self.num_embeddings))
    assert not _same_as_plain("llama")


def test_the_device_peak_drops_by_the_embedding_which_the_tracker_files_as_host_bytes():
    import memfit.train.traced  # noqa: F401  (registers the step the traced estimate runs)
    from memfit.prediction.estimator import estimate

    plain, moved = _lora("gpt_oss"), _lora("gpt_oss")
    embedding_bytes = moved.get_input_embeddings().weight.nbytes
    embedding_to_host(moved)
    before, after = tracked_step(plain, _tokens()), tracked_step(moved, _tokens())
    assert before.peak_bytes - after.peak_bytes == embedding_bytes
    assert after.host_peak_bytes == embedding_bytes and before.host_peak_bytes == 0
    # the estimate moves the same bytes off the device
    hf_config = ZOO["gpt_oss"]()
    settings = dict(model="tiny", lora_r=2, seq_len=24, batch_size=2, loss_chunk_size=0)
    base = estimate(TrainConfig.from_flat(settings), hf_config=hf_config)
    on_host = estimate(TrainConfig.from_flat({**settings, "embedding_on_host": True}), hf_config=hf_config)
    assert base.breakdown["parameters"] - on_host.breakdown["parameters"] == embedding_bytes
    assert on_host.host_breakdown["embedding"] == embedding_bytes
    traced = [estimate(TrainConfig.from_flat({**settings, "embedding_on_host": on}), hf_config=hf_config,
                       method="traced") for on in (False, True)]  # traced without it, its bytes from the parts
    assert traced[0].breakdown["parameters"] - traced[1].breakdown["parameters"] == embedding_bytes


def test_a_trained_tied_or_subclassed_embedding_stays_where_it_is():
    full = build_model("llama")
    assert embedding_to_host(full) == ("off: the input embedding trains (a full fine-tune or a trained embedding):"
                                       " it stays on the device")
    tied = build_model("llama")
    tied.tie_weights = None  # keep the call below from retying
    tied.lm_head.weight = tied.get_input_embeddings().weight
    tied.requires_grad_(False)
    assert "tied to the output head" in embedding_to_host(tied)
    gemma = build_model("gemma3_text").requires_grad_(False)
    assert "its own forward" in embedding_to_host(gemma)
    assert not embedding_on_host(tied) and not embedding_on_host(gemma)


def test_embedding_on_host_without_lora_is_refused_in_one_line():
    with pytest.raises(UsageError, match="--embedding-on-host keeps a frozen embedding in host memory: add --lora-r"):
        TrainConfig.from_flat(dict(model="tiny", embedding_on_host=True)).validate()


def test_embedding_on_host_under_several_ranks_is_refused_in_one_line():
    config = TrainConfig.from_flat(dict(model="tiny", lora_r=2, embedding_on_host=True))
    config.validate()
    with pytest.raises(UsageError, match="--embedding-on-host runs in one process"):
        config.validate(world_size=2)

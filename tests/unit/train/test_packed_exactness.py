"""Packed rows train exactly as their samples one by one: same per-sample losses, gradients and weights.

Everything runs in fp32 on the CPU. SGD without clipping moves each weight by its gradient, so a
sample that sees another (attention crossing a boundary) or a position that does not restart
shows in the weights. Each check has a fault twin that breaks one of the two and must fail.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from memfit.config_loading import load_config
from memfit.data import collate
from memfit.data.packing import PackedDataset, best_fit_decreasing
from memfit.data.prefetch import BatchPrefetcher
from memfit.techniques.loss import causal_lm_loss_sum
from memfit.train.metrics import read_metrics
from memfit.train.step import packed_positions
from synthetic_samples import SyntheticSamples

SEQ_LEN = 64


def Samples(lengths, seed: int = 0) -> SyntheticSamples:  # noqa: N802  (reads as the dataset it builds)
    """Samples of varied lengths with a masked prompt (a quarter of each), as the supervised formats produce."""
    return SyntheticSamples(lengths, seed, prompt_share=4)


def tiny_model(kind: str, attention: str, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
    else:  # learned absolute positions: a position that does not restart changes the numbers even inside a sample
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
    model.config._attn_implementation = attention
    return model


def packed_batch(rows: list[dict]) -> dict:
    """The batch as the step builds it: collated, the mask of packed rows dropped (memfit.data.prefetch)."""
    return BatchPrefetcher(lambda s: collate(s, 0), torch.device("cpu"), drop_full_attention_mask=True).take(rows)


def forward_logits(model, batch: dict, fault: str | None = None) -> torch.Tensor:
    kwargs = packed_positions(batch)
    if fault == "positions not restarted":
        kwargs = {}  # positions run on across the row, and nothing tells the kernel where samples end
    if fault == "mask dropped":
        batch = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}  # positions restart, attention crosses
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False, **kwargs).logits


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction="none").view(labels.shape)


def packed_sample_losses(model, dataset: PackedDataset, fault: str | None = None) -> dict[int, float]:
    """Summed loss of every sample, read from packed rows (all rows in one padded micro-batch)."""
    rows = [dataset[i] for i in range(len(dataset))]
    batch = packed_batch(rows)
    losses = per_token_losses(forward_logits(model, batch, fault), batch["labels"])
    found = {}
    for r, members in enumerate(dataset.rows):
        start = 0
        for index in members.tolist():
            length = int(dataset.sample_lengths[index])
            found[index] = float(losses[r, start : start + length].sum())
            start += length
    return found


def lengths_of_varied_samples(count: int = 14, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, 40, size=count).tolist()


@pytest.mark.parametrize(("kind", "attention"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_packed_rows_give_each_sample_its_own_loss(kind, attention):
    samples = Samples(lengths_of_varied_samples())
    packed = PackedDataset(samples, SEQ_LEN)
    assert max(len(row) for row in packed.rows) > 1  # several samples share a row
    model = tiny_model(kind, attention).eval()
    with torch.no_grad():
        found = packed_sample_losses(model, packed)
        for index, sample in enumerate(samples.items):
            alone = per_token_losses(model(input_ids=sample["input_ids"][None], use_cache=False).logits,
                                     sample["labels"][None]).sum()
            assert found[index] == pytest.approx(float(alone), rel=1e-5, abs=1e-5), f"sample {index}"


@pytest.mark.parametrize(("kind", "fault"), [("llama", "mask dropped"), ("llama", "positions not restarted"),
                                             ("gpt2", "mask dropped"), ("gpt2", "positions not restarted")])
def test_per_sample_loss_check_fails_on_a_faulty_packing(kind, fault):
    samples = Samples(lengths_of_varied_samples())
    packed = PackedDataset(samples, SEQ_LEN)
    model = tiny_model(kind, "sdpa").eval()
    with torch.no_grad():
        found = packed_sample_losses(model, packed, fault)
        differences = []
        for index, sample in enumerate(samples.items):
            alone = per_token_losses(model(input_ids=sample["input_ids"][None], use_cache=False).logits,
                                     sample["labels"][None]).sum()
            differences.append(abs(found[index] - float(alone)))
    assert max(differences) > 1e-3


def sgd_weights(model, micro_batches: list[dict], normalizer: int, steps: int, chunk: int = 0,
                fault: str | None = None) -> dict[str, torch.Tensor]:
    """SGD (lr 1, no clipping, no momentum) over the same micro-batches each step; the loss as the step forms it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for batch in micro_batches:
            positions = packed_positions(batch)
            mask = batch.get("attention_mask")
            if fault == "positions not restarted":
                positions = {}
            if fault == "mask dropped" and positions:
                mask = torch.ones_like(batch["input_ids"])
            loss = causal_lm_loss_sum(model, batch["input_ids"], batch["labels"], mask, chunk, **positions)
            (loss / normalizer).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


WEIGHT_SAMPLES = Samples(lengths_of_varied_samples(count=9, seed=1), seed=1)
WEIGHT_TARGETS = sum(int((s["labels"][1:] != -100).sum()) for s in WEIGHT_SAMPLES.items)


@functools.cache
def weights_one_by_one(kind: str, attention: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """The reference: each sample its own micro-batch (no padding, no packing); shared by the checks and twins."""
    alone = [collate([sample], 0) for sample in WEIGHT_SAMPLES.items]
    return sgd_weights(tiny_model(kind, attention), alone, WEIGHT_TARGETS, steps)


def one_by_one_and_packed(kind: str, attention: str, chunk: int, fault: str | None, steps: int = 3):
    packed = PackedDataset(WEIGHT_SAMPLES, SEQ_LEN)
    rows = [packed[i] for i in range(len(packed))]
    assert len(rows) >= 2 and max(len(row) for row in packed.rows) > 1
    # Two micro-batches of packed rows, each padded to its longest row.
    micro_batches = [packed_batch(rows[: len(rows) // 2]), packed_batch(rows[len(rows) // 2 :])]
    assert any("position_ids" in b and b["position_ids"].eq(0).sum() > len(b["position_ids"]) for b in micro_batches)
    trained = sgd_weights(tiny_model(kind, attention), micro_batches, WEIGHT_TARGETS, steps, chunk, fault)
    return weights_one_by_one(kind, attention, steps), trained


@pytest.mark.parametrize(("kind", "attention", "chunk"), [("llama", "sdpa", 0), ("llama", "eager", 0),
                                                          ("llama", "sdpa", 16), ("gpt2", "sdpa", 0)])
def test_packed_micro_batches_give_the_weights_of_samples_one_by_one(kind, attention, chunk):
    reference, trained = one_by_one_and_packed(kind, attention, chunk, fault=None)
    for name, weight in reference.items():
        torch.testing.assert_close(trained[name], weight, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(("kind", "fault"), [("llama", "mask dropped"), ("llama", "positions not restarted"),
                                             ("gpt2", "positions not restarted")])
def test_weights_check_fails_on_a_faulty_packing(kind, fault):
    reference, trained = one_by_one_and_packed(kind, "sdpa", 0, fault)
    worst = max(float((trained[name] - weight).abs().max()) for name, weight in reference.items())
    assert worst > 1e-4


# -- the real training loop: --packing samples against --packing off ----------------------------------


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Twelve documents of 8 to 50 bytes (byte tokenizer: one token a byte, plus EOS)."""
    rng = random.Random(3)
    words = "memory gradient batch token model layer fits device loss step".split()
    documents = []
    while len(documents) < 12:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        if 8 <= len(text) <= 50:
            documents.append(text)
    path = tmp_path_factory.mktemp("short") / "short.txt"
    path.write_text("\n\n".join(documents))
    return path, [len(d) + 1 for d in documents]


def run_weights(llama_dir, dataset_path, out, packing: str, rows: int, micro_batch: int):
    from memfit.train.loop import train

    config = load_config(overrides=dict(
        model=str(llama_dir), dataset=str(dataset_path), seq_len=SEQ_LEN, packing=packing,
        effective_batch_size=rows, batch_size=micro_batch, max_steps=3, optimizer="sgd", lr=1.0, max_grad_norm=0,
        loss_chunk_size=0, lr_schedule="constant", precision="fp32", output_dir=str(out / packing), report=False,
    ))
    result = train(config)
    return load_file(str(result.final_dir / "model.safetensors")), result


@pytest.fixture(scope="module")
def documents_off(llama_dir, short_documents, tmp_path_factory):
    """The `off` run of the short documents: the reference of the check and of its twin."""
    path, lengths = short_documents
    return run_weights(llama_dir, path, tmp_path_factory.mktemp("off"), "off", len(lengths), 4)


def test_samples_and_off_train_to_the_same_weights(llama_dir, short_documents, documents_off, tmp_path):
    """Every step takes the whole (small) dataset: one padded sample per row, or packed rows."""
    path, lengths = short_documents
    packed_rows = len(best_fit_decreasing(lengths, SEQ_LEN))
    assert packed_rows < len(lengths)
    off, off_result = documents_off
    samples, samples_result = run_weights(llama_dir, path, tmp_path, "samples", packed_rows, 2)
    assert samples_result.losses == pytest.approx(off_result.losses, abs=1e-5)
    for name, weight in off.items():
        torch.testing.assert_close(samples[name], weight, atol=1e-5, rtol=0, msg=name)
    start = read_metrics(tmp_path / "samples" / "metrics.jsonl")[0]
    assert start["packing"]["mode"] == "samples"
    assert start["packing"]["rows"] == packed_rows
    assert "block-diagonal" in start["packing"]["attention_restriction"]


def test_samples_against_off_fails_when_positions_do_not_reach_the_model(llama_dir, short_documents, documents_off,
                                                                         tmp_path, monkeypatch):
    import memfit.train.step as step

    path, lengths = short_documents
    packed_rows = len(best_fit_decreasing(lengths, SEQ_LEN))
    off, _ = documents_off
    monkeypatch.setattr(step, "packed_positions", lambda batch: {})
    samples, _ = run_weights(llama_dir, path, tmp_path, "samples", packed_rows, 2)
    assert max(float((samples[name] - weight).abs().max()) for name, weight in off.items()) > 1e-4


@pytest.mark.gpu
def test_flash_attention_varlen_keeps_samples_apart():
    """On CUDA with flash-attn: packed rows without a mask go through its variable-length path (bf16 tolerance)."""
    pytest.importorskip("flash_attn")
    samples = Samples(lengths_of_varied_samples())
    packed = PackedDataset(samples, SEQ_LEN)
    model = tiny_model("llama", "flash_attention_2").to("cuda", torch.bfloat16).eval()
    rows = [packed[i] for i in range(len(packed))]
    batch = {name: tensor.cuda() for name, tensor in packed_batch(rows).items()}
    assert "attention_mask" not in batch
    with torch.no_grad():
        logits = forward_logits(model, batch).float()
        for r, members in enumerate(packed.rows):
            start = 0
            for index in members.tolist():
                ids = samples[index]["input_ids"].cuda()[None]
                alone = model(input_ids=ids, use_cache=False).logits.float()[0]
                torch.testing.assert_close(logits[r, start : start + len(ids[0])], alone, atol=3e-2, rtol=3e-2)
                start += len(ids[0])


@pytest.fixture(scope="module")
def short_conversations(tmp_path_factory):
    """Ten multi-turn conversations of the bundled chat set that fit in one window each."""
    import importlib.resources
    import json

    lines = (importlib.resources.files("memfit.data") / "chat" / "chat.jsonl").read_text().splitlines()
    short = [line for line in lines if len(line) < 260][:10]
    assert len(short) == 10 and any(len(json.loads(line)["messages"]) > 2 for line in short)
    path = tmp_path_factory.mktemp("chat") / "short.jsonl"
    path.write_text("\n".join(short) + "\n")
    return path


def test_conversations_packed_train_to_the_weights_of_one_per_row(llama_dir, short_conversations, tmp_path):
    """Supervised data (loss on the answers only): `samples` (the default) against `off`, the whole set each step."""
    from memfit.data import load_training_data
    from memfit.models.loader import load_tokenizer

    def config(packing: str, rows: int, micro_batch: int):
        return load_config(overrides=dict(
            model=str(llama_dir), dataset=str(short_conversations), chat_template="chatml", seq_len=SEQ_LEN * 4,
            packing=packing, effective_batch_size=rows, batch_size=micro_batch, max_steps=2, optimizer="sgd", lr=1.0,
            max_grad_norm=0, loss_chunk_size=0, lr_schedule="constant", precision="fp32",
            output_dir=str(tmp_path / packing), cache_dir=str(tmp_path / "cache"), report=False,
        ))

    from memfit.train.loop import train

    probe = config("off", 10, 5)
    samples = load_training_data(probe.data, load_tokenizer(str(llama_dir), False))
    assert len(samples) == 10 and int(np.sum(samples.lengths)) > 0
    packed_rows = len(best_fit_decreasing(samples.lengths, SEQ_LEN * 4))
    assert packed_rows < 10
    off = train(probe)
    micro_batch = 3 if packed_rows % 3 == 0 else 1  # several micro-batches: accumulation over packed rows too
    packed = train(config("auto", packed_rows, micro_batch))
    assert packed.losses == pytest.approx(off.losses, abs=1e-5)
    off_weights = load_file(str(off.final_dir / "model.safetensors"))
    packed_weights = load_file(str(packed.final_dir / "model.safetensors"))
    for name, weight in off_weights.items():
        torch.testing.assert_close(packed_weights[name], weight, atol=1e-5, rtol=0, msg=name)
    assert read_metrics(tmp_path / "auto" / "metrics.jsonl")[0]["packing"]["mode"] == "samples"

"""Chunked cross-entropy: same loss and gradients as the plain loss, without the full logits."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from memfit.techniques.loss import (
    IGNORE_INDEX,
    causal_lm_loss_sum,
    count_target_tokens,
    default_loss_chunk_size,
)
from tiny_llama import tiny_llama as shared_tiny_llama


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under the mode and still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def tiny_llama(vocab_size: int = 256) -> LlamaForCausalLM:
    return shared_tiny_llama(vocab=vocab_size)


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=300,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no dropout: the two losses must see the same network
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def batch_with_padding(vocab_size: int, batch: int = 3, seq: int = 40):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[0, 25:] = IGNORE_INDEX  # padding at the end of one row
    labels[1, :7] = IGNORE_INDEX  # context without loss at the start of another
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 25:] = 0
    return input_ids, labels, attention_mask


def loss_and_grads(model, chunk_size, input_ids, labels, attention_mask):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss_sum(model, input_ids, labels, attention_mask, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2-tied"])
@pytest.mark.parametrize("chunk_size", [7, 32, 10_000])
def test_chunked_loss_and_grads_equal_plain(build, chunk_size):
    model = build()
    batch = batch_with_padding(model.config.vocab_size)
    plain_loss, plain_grads = loss_and_grads(model, 0, *batch)
    chunked_loss, chunked_grads = loss_and_grads(model, chunk_size, *batch)

    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=0)
    assert chunked_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        # Chunks sum the head's gradient in another order: compare as a whole tensor.
        relative_error = (chunked_grads[name] - grad).norm() / grad.norm()
        assert relative_error < 1e-6, (name, relative_error.item())


def test_tied_head_gets_gradient_from_both_uses():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    _, grads = loss_and_grads(model, 16, *batch_with_padding(model.config.vocab_size))
    assert "transformer.wte.weight" in grads and grads["transformer.wte.weight"].abs().sum() > 0


def test_softcapping_from_config_is_applied():
    model = tiny_llama()
    model.config.final_logit_softcapping = 2.0
    model.config.logit_scale = 3.0
    batch = batch_with_padding(model.config.vocab_size)
    chunked = causal_lm_loss_sum(model, *batch, chunk_size=16)
    # The reference applies the same post-processing by hand on the full logits.
    logits = model(input_ids=batch[0], attention_mask=batch[2]).logits[:, :-1].float() * 3.0
    logits = torch.tanh(logits / 2.0) * 2.0
    reference = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch[1][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=0)


def test_all_labels_ignored_gives_zero_with_working_backward():
    model = tiny_llama()
    input_ids = torch.randint(0, 256, (2, 8))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    loss = causal_lm_loss_sum(model, input_ids, labels, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0


def test_chunked_loss_drops_peak_by_about_the_logits():
    vocab, batch, seq, chunk = 32000, 1, 256, 32
    model = tiny_llama(vocab)
    input_ids = torch.randint(0, vocab, (batch, seq))
    logits_fp32_bytes = batch * (seq - 1) * vocab * 4

    peaks = {}
    for chunk_size in (0, chunk):
        model.zero_grad(set_to_none=True)
        with LiveBytes() as meter:
            loss = causal_lm_loss_sum(model, input_ids, input_ids, chunk_size=chunk_size)
            loss.backward()
            del loss
        peaks[chunk_size] = meter.peak

    saved = peaks[0] - peaks[chunk]
    # Plain holds at least two logits-sized fp32 tensors at once; chunked holds a few chunks.
    assert saved > 1.5 * logits_fp32_bytes, (peaks, logits_fp32_bytes)
    assert peaks[chunk] < peaks[0] / 2


def test_count_target_tokens_matches_the_shifted_labels():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 3]])
    assert count_target_tokens(labels) == 1 + 3


@pytest.mark.parametrize(
    ("vocab", "seq", "batch", "expected"),
    [(256, 2048, 8, 0), (50257, 1024, 8, 1024), (128256, 8192, 1, 1024), (32000, 64, 4, 0)],
)
def test_default_chunk_size_rule(vocab, seq, batch, expected):
    assert default_loss_chunk_size(vocab, seq, batch) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_loss_lowers_the_cuda_peak_by_more_than_the_logits():
    vocab, batch, seq = 32000, 4, 1024
    model = tiny_llama(vocab).cuda()
    input_ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    logits_fp32_bytes = batch * (seq - 1) * vocab * 4
    peaks, losses = {}, {}
    for chunk_size in (0, 1024):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = causal_lm_loss_sum(model, input_ids, input_ids, chunk_size=chunk_size)
        loss.backward()
        torch.cuda.synchronize()
        peaks[chunk_size] = torch.cuda.max_memory_allocated() - before
        losses[chunk_size] = loss.detach()
        del loss
    assert peaks[0] - peaks[1024] > logits_fp32_bytes, (peaks, logits_fp32_bytes)
    torch.testing.assert_close(losses[1024], losses[0], rtol=1e-5, atol=0)


def test_chunked_loss_runs_through_a_lora_wrapped_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)  # a trained adapter, so it shows in the loss
    batch = batch_with_padding(model.config.vocab_size)
    plain_loss, plain_grads = loss_and_grads(model, 0, *batch)
    chunked_loss, chunked_grads = loss_and_grads(model, 16, *batch)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=0)
    assert plain_grads.keys() == chunked_grads.keys() and all("lora_" in name for name in plain_grads)
    for name, grad in plain_grads.items():
        assert (chunked_grads[name] - grad).norm() / grad.norm() < 1e-6, name


def test_chunked_loss_traces_under_fake_tensors():
    """Shapes never depend on the labels: the traced estimate runs the chunked loss on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = tiny_llama(vocab_size=32000)
        input_ids = torch.randint(0, 32000, (2, 64))
        labels = input_ids.clone()
        labels[0, 40:] = IGNORE_INDEX
        loss = causal_lm_loss_sum(model, input_ids, labels, chunk_size=16)
        loss.backward()
        assert loss.shape == () and model.lm_head.weight.grad.shape == (32000, 64)


def test_a_doubled_chunk_gradient_fails_the_comparison(monkeypatch):
    """The equality test above catches a scale error in the checkpointed chunks' backward (the path of a head whose
    gradient is not accumulated in place; tests/unit/techniques/test_chunked_head_loss.py has the in-place twin)."""
    import memfit.techniques.loss as loss_module

    monkeypatch.setattr(loss_module, "in_place_head_problem", lambda *args: "the checkpointed chunks are under test")

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    model = tiny_llama()
    batch = batch_with_padding(model.config.vocab_size)
    _, plain_grads = loss_and_grads(model, 0, *batch)
    chunk_loss = loss_module._chunk_loss
    monkeypatch.setattr(loss_module, "_chunk_loss", lambda *args: Doubled.apply(chunk_loss(*args)))
    _, chunked_grads = loss_and_grads(model, 16, *batch)
    errors = [((chunked_grads[n] - g).norm() / g.norm()).item() for n, g in plain_grads.items()]
    assert min(errors) > 0.5  # every gradient flows through the chunks: all of them are off


FSDP_CASES = [("untied", 0, "eager"), ("tied", 0, "eager"), ("untied", 3, "eager"), ("untied", 3, "compiled")]


def _fsdp_tiny(head):
    from transformers import LlamaConfig

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=256, tie_word_embeddings=head == "tied"))


def _fsdp_case(head, tiles, blocks, out_dir):
    """One case on this rank: 2 steps of the chunked loss under FSDP2 against the plain loss of one whole model;
    writes rank{R}-{head}-{tiles}-{blocks}.txt."""
    import torch.distributed as dist

    from memfit.distributed.fsdp import fully_shard_model
    from memfit.techniques.tiled_mlp import apply_tiled_mlp

    input_ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(3))
    labels = input_ids.clone()
    labels[0, 30:] = -100
    reference = _fsdp_tiny(head)
    reference_loss = causal_lm_loss_sum(reference, input_ids, labels, chunk_size=0)
    reference_loss.backward()
    model = _fsdp_tiny(head)
    apply_tiled_mlp(model, tiles)  # 0: plain MLPs
    if blocks == "compiled":  # blocks compiled after tiling and before sharding, as setup does
        from memfit.techniques.compile import compile_blocks, compile_stats

        graphs_before = compile_stats()["compiled_graphs"]  # the process's count: earlier cases' graphs left out
        compile_blocks(model, torch.device("cpu"), backend="aot_eager")
    fully_shard_model(model, dist.get_world_size(), torch.device("cpu"))
    for _ in range(2):  # the second step runs with the root's state set up by the first
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss_sum(model, input_ids, labels, chunk_size=16)
        loss.backward()
    # Every rank saw the same batch: the mean over ranks is the single-process gradient.
    errors = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
        expected = reference.get_parameter(name).grad
        errors[name] = ((grad - expected).norm() / expected.norm()).item()
    if blocks == "compiled":
        compiled = compile_stats()["compiled_graphs"] - graphs_before
        assert compiled >= 3, compile_stats()  # nothing fell back to eager
    (out_dir / f"rank{dist.get_rank()}-{head}-{tiles}-{blocks}.txt").write_text(
        f"{loss.item()!r} {reference_loss.item()!r} {max(errors.values())!r}")
    dist.barrier()  # the next case's collectives start on both ranks together


def _fsdp_rank(rank, out_dir, world):
    """A rank forked from this test process (torch, transformers and memfit imported already): every case."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)  # one thread per rank on a 2-core machine
    torch._dynamo.reset()  # compile afresh, as a new process would: the test process may have compiled these blocks
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # a rank stuck in a collective fails, not hangs
    for head, tiles, blocks in FSDP_CASES:
        _fsdp_case(head, tiles, blocks, out_dir)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_chunked_losses(tmp_path_factory):
    """Every case of FSDP_CASES on 2 gloo ranks forked from this process: a torchrun launch would import torch,
    transformers and memfit again in its agent and in each rank (measured: most of the launch's time)."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("fsdp-chunked-loss")
    mp.start_processes(_fsdp_rank, args=(root, 2), nprocs=2, join=True, start_method="fork")
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("head", "tiles", "blocks"), FSDP_CASES)
def test_chunked_loss_under_fsdp2_equals_the_plain_single_process_loss(head, tiles, blocks, fsdp_chunked_losses):
    """FSDP2 gathers the root unit's head in the root's forward, which the chunked loss now runs.

    With `tiles`, the blocks' MLPs are tiled too: their recompute runs on the gathered weights.
    With `blocks="compiled"`, the tiled blocks are also compiled (--compile) before sharding.
    """
    for rank in (0, 1):
        result = fsdp_chunked_losses / f"rank{rank}-{head}-{tiles}-{blocks}.txt"
        loss, reference, worst = result.read_text().split()
        assert float(loss) == pytest.approx(float(reference), rel=1e-6)
        assert float(worst) < 1e-6


def _preset_names() -> list[str]:
    from memfit.models.presets import list_model_presets

    return [preset.name for preset in list_model_presets()]


def _traced_representatives() -> set[str]:
    """The smallest preset of each shape class: family, tied or untied head.

    The traced step costs a fake-tensor dispatch per operator (an 80-layer preset, about 35 s on
    2 cores), and presets of one class run the same operators in the same order, at other sizes:
    tracing the smallest of each class exercises every code path the trace has.
    """
    from memfit.models.presets import list_model_presets

    chosen: dict[tuple, str] = {}
    for preset in list_model_presets():  # smallest first
        chosen.setdefault((preset.model_type, preset.tie_embeddings), preset.name)
    return set(chosen.values())


def _first_blocks(preset: str, count: int):
    """The preset's config cut to its first `count` blocks (per-layer lists cut with it)."""
    from memfit.models.presets import resolve_model_config

    hf_config = resolve_model_config(preset)
    layers = hf_config.num_hidden_layers
    if layers > count:
        for name, value in list(vars(hf_config).items()):
            if isinstance(value, list) and len(value) == layers:
                setattr(hf_config, name, value[:count])
        hf_config.num_hidden_layers = count
    return hf_config


@pytest.mark.slow
@pytest.mark.parametrize("preset", _preset_names())
def test_every_preset_estimates_with_both_methods(preset):
    """Every preset estimates analytically; the smallest of its shape class also traced, on fake tensors.

    The traced step runs the default loss for the shape. 512 tokens instead
    of the usual 2048 keep it to seconds: the trace's shapes do not depend on the length (the
    CLI test below runs 2048).
    """
    from memfit import TrainConfig, estimate
    from memfit.models.presets import find_preset

    config = TrainConfig()
    config.model.model = preset
    if find_preset(preset).model_type in ("esm", "bert", "modernbert"):
        config.task.task = "masked-lm"  # an encoder has no causal-LM head (refused: tests/unit/prediction)
    config.data.seq_len = 512
    config.training.batch_size = 2  # 1022 targets: within one 1024-token chunk, so the default loss is unchunked
    analytical = estimate(config, method="analytical")
    assert analytical.peak_bytes > 0
    # The chunk decision is the default rule's for this vocabulary and shape; the class's representative,
    # traced below, checks it against the trace.
    vocab = find_preset(preset).vocab_size
    assert analytical.details["loss_chunk_size"] == default_loss_chunk_size(vocab, 512, 2)
    if preset not in _traced_representatives():
        return
    # Traced (and compared) on the preset's first four blocks: every kind of block a family has is among them
    # (DeepSeek-V3's three dense layers, then experts; alternating attention kinds), and a full-size trace on fake
    # tensors took up to 28 s a preset; the analytical figure above stays the whole model's.
    blocks = _first_blocks(preset, 4)
    analytical = estimate(config, method="analytical", hf_config=blocks)
    traced = estimate(config, method="traced", hf_config=blocks)
    chunked = traced.details["loss_chunk_size"] > 0
    assert chunked == (analytical.details["loss_chunk_size"] > 0)
    # Both count the same weights and AdamW state; they differ in the activations only.
    assert traced.peak_bytes == pytest.approx(analytical.peak_bytes, rel=0.25)


@pytest.mark.slow
def test_traced_estimate_cli_on_llama_3_2_1b_at_2048_tokens(warm_memfit):
    import json

    # forked from the session's warm server (tests/memfit_cli.py): the real command without a fresh import
    result = warm_memfit.run(
        "estimate", "--model", "llama-3.2-1b", "--seq-len", "2048", "--batch-size", "1", "--method", "traced", "--json"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout)
    assert data["method"] == "traced" and data["details"]["loss_chunk_size"] == 1024
    # No [2047 x 128256] fp32 logits (1 GiB) at the peak: the chunked loss held one chunk.
    assert data["breakdown"]["logits"] < 2048 * 128256 * 4 / 4

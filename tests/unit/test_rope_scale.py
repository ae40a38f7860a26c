"""--rope-scale: the loaded model's RoPE is transformers' own for the scaled config, and training past
the model's positions equals a model built directly with that config."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fault_injection import SGD_NO_CLIPPING, largest_update, scaled_gradients
from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.models.loader import load_model_and_tokenizer

POSITIONS = 64
SDPA = SimpleNamespace(implementation="sdpa", hf_name="sdpa")
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _config(positions: int = POSITIONS, **overrides) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, eos_token_id=256, pad_token_id=256,
        bos_token_id=256, **overrides,
    )


def _save(directory, config):
    from memfit.models.tiny import byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory):
    """A Llama with 64 positions and plain RoPE, saved with save_pretrained."""
    return _save(tmp_path_factory.mktemp("short"), _config())


@pytest.fixture(scope="module")
def llama3_llama(tmp_path_factory):
    """The same with Llama 3.1's RoPE scaling (factor 4 over 16 pretraining positions)."""
    return _save(tmp_path_factory.mktemp("llama3"), _config(rope_parameters=dict(LLAMA3)))


def _load(model_dir, tmp_path, **flags):
    config = load_config(overrides=dict(model=str(model_dir), output_dir=str(tmp_path / "out"), **flags))
    return load_model_and_tokenizer(config, torch.device("cpu"), SDPA)


def _reference_config(rope_parameters: dict, positions: int) -> LlamaConfig:
    """The config a user would write by hand for transformers: the scaled RoPE, the longer positions."""
    return _config(positions, rope_parameters=dict(rope_parameters))


SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": POSITIONS},
}


def _rotary_outputs(rotary, positions: int):
    x = torch.zeros(1, positions, 16)
    return rotary(x, torch.arange(positions)[None])


@pytest.mark.parametrize("kind", ["linear", "yarn", "auto"])
def test_the_flag_gives_transformers_rope_of_the_scaled_config(short_llama, tmp_path, kind):
    loaded = _load(short_llama, tmp_path, rope_scale=4, rope_scaling=kind)
    expected_type = "yarn" if kind == "auto" else kind  # auto gives unscaled RoPE YaRN
    assert loaded.max_positions == 4 * POSITIONS and loaded.model.config.max_position_embeddings == 4 * POSITIONS
    assert loaded.rope_scaling.rope_type == expected_type and loaded.rope_scaling.positions_before == POSITIONS
    reference = _reference_config(SCALED[expected_type], 4 * POSITIONS)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[expected_type](reference)
    rotary = loaded.model.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, inv_freq, atol=0, rtol=0)
    assert rotary.attention_scaling == pytest.approx(attention_scaling)
    for got, want in zip(_rotary_outputs(rotary, 4 * POSITIONS), _rotary_outputs(LlamaRotaryEmbedding(reference), 4 * POSITIONS),
                         strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # and it really is another rotation than the model's own
    plain = LlamaRotaryEmbedding(_config())
    assert not torch.allclose(rotary.inv_freq, plain.inv_freq)


def test_a_llama3_model_keeps_its_type_and_multiplies_its_factor(llama3_llama, tmp_path):
    loaded = _load(llama3_llama, tmp_path, rope_scale=2)
    params = loaded.model.config.rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert params["original_max_position_embeddings"] == 16 and loaded.max_positions == 2 * POSITIONS
    reference = _reference_config(dict(LLAMA3, factor=8.0), 2 * POSITIONS)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](reference)
    torch.testing.assert_close(loaded.model.model.rotary_emb.inv_freq, inv_freq, atol=0, rtol=0)
    with pytest.raises(UsageError, match="already uses llama3"):
        _load(llama3_llama, tmp_path, rope_scale=2, rope_scaling="yarn")


@pytest.mark.parametrize("flags", [{}, {"rope_scale": 1}])
def test_absent_or_factor_one_leaves_the_model_bit_identical(short_llama, tmp_path, flags):
    plain = _load(short_llama, tmp_path)
    other = _load(short_llama, tmp_path, **flags)
    assert other.rope_scaling is None and other.max_positions == POSITIONS
    assert other.model.config.to_dict() == plain.model.config.to_dict()
    torch.testing.assert_close(other.model.model.rotary_emb.inv_freq, plain.model.model.rotary_emb.inv_freq, atol=0, rtol=0)
    ids = torch.arange(POSITIONS)[None] % 256
    torch.testing.assert_close(other.model(ids).logits, plain.model(ids).logits, atol=0, rtol=0)


def _train(model_dir, text_file, out, **flags):
    from memfit.train.loop import train

    config = load_config(overrides=dict(
        model=str(model_dir), dataset=str(text_file), seq_len=4 * POSITIONS, batch_size=2, max_steps=1, lr=0.5,
        loss_chunk_size=0, output_dir=str(out), rope_scale=4, rope_scaling="linear", **SGD_NO_CLIPPING, **flags,
    ))
    return config, train(config)


def _reference_update(model_dir, config, rope_parameters):
    """Loss and weights after one SGD step of a model built directly from the transformers config."""
    from memfit.data import BatchSchedule, collate, load_training_data
    from memfit.models.loader import load_tokenizer

    data = replace(config.data, cache_dir=str(config.output.output_dir) + "-reference-cache")
    dataset = load_training_data(data, load_tokenizer(str(model_dir), False))
    indices = BatchSchedule(len(dataset), 2, config.training.seed, 0, 1).batch_indices(0)
    batch = collate([dataset[i] for i in indices], 256)
    model = LlamaForCausalLM(_reference_config(rope_parameters, 4 * POSITIONS))
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    loss = model(**batch).loss  # the mean over the batch's target tokens, as memfit normalizes it
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    return loss.item(), {name: t.detach() for name, t in model.state_dict().items()}


def _assert_same(weights: dict, reference: dict) -> None:
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name], atol=2e-6, rtol=0, msg=name)


def test_training_past_the_positions_equals_the_directly_built_model(short_llama, text_file, tmp_path):
    config, result = _train(short_llama, text_file, tmp_path / "scaled")
    assert result.summary["rope_scaling"].startswith("linear x4") and result.summary["seq_len"] == 4 * POSITIONS
    weights = load_file(str(result.final_dir / "model.safetensors"))
    initial = load_file(str(short_llama / "model.safetensors"))
    assert largest_update(initial, weights) > 1e-2  # the update is large beside the tolerance
    loss, reference = _reference_update(short_llama, config, {"rope_type": "linear", "factor": 4.0})
    assert result.losses[0] == pytest.approx(loss, abs=1e-5)
    _assert_same(weights, reference)
    # the comparison sees the RoPE: the model's own rotation at the same positions trains to other weights
    _, plain = _reference_update(short_llama, config, {"rope_type": "default"})
    with pytest.raises(AssertionError):
        _assert_same(weights, plain)
    # and it sees a 2x gradient error
    with scaled_gradients(2.0):
        _, faulty = _train(short_llama, text_file, tmp_path / "faulty")
    with pytest.raises(AssertionError):
        _assert_same(load_file(str(faulty.final_dir / "model.safetensors")), reference)
    # the saved model keeps its scaled RoPE: it loads with the longer positions without the flag
    again = _load(result.final_dir, tmp_path)
    assert again.max_positions == 4 * POSITIONS and again.model.config.rope_parameters["factor"] == 4.0


def test_bad_input_is_one_line_exit_2_and_writes_nothing(short_llama, gpt2_dir, text_file, tmp_path, warm_memfit):
    for flags, words in (
        (["--rope-scale", "0.5"], "at least 1"),
        (["--rope-scale", "four"], "takes a number"),
        (["--rope-scaling", "yarn"], "needs --rope-scale"),
        (["--model", str(gpt2_dir), "--rope-scale", "2"], "rotary position embeddings"),
        (["--seq-len", str(4 * POSITIONS)], "--rope-scale 4"),  # the refusal names the flag and its factor
    ):
        out = tmp_path / "out"
        argv = ["train", "--model", str(short_llama), "--dataset", str(text_file), "--max-steps", "1",
                "--output-dir", str(out), *flags]
        done = warm_memfit.run(*argv)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0], done.stderr
        assert not out.exists()
    done = warm_memfit.run("estimate", "--model", "gpt2", "--seq-len", "512", "--rope-scale", "2")
    assert done.returncode == 2 and "rotary position embeddings" in done.stderr


def test_plan_caps_at_the_positions_and_names_the_scale_that_reaches_memory():
    from memfit.cli.flags import parse_command_line
    from memfit.prediction.planner import plan
    from memfit.units import GIB

    flags = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear"}
    own = plan(load_config(overrides=flags), gpu="h100", allow="qlora", maximize="seq-len", host_memory=512 * GIB)
    assert own.plan["seq_len"] == own.max_positions == 131_072 and own.memory_limit_seq_len >= 300_000
    assert own.rope_scale_to_memory_limit * 131_072 >= own.memory_limit_seq_len
    assert any(f"--rope-scale {own.rope_scale_to_memory_limit} extends" in t for t in own.trades)
    assert "--rope-scale" not in own.command
    scaled = plan(load_config(overrides=flags | {"rope_scale": 4}), gpu="h100", allow="qlora", maximize="seq-len",
                  host_memory=512 * GIB)
    assert scaled.max_positions == 4 * 131_072 and 300_000 <= scaled.plan["seq_len"] <= 4 * 131_072
    assert scaled.to_dict()["max_positions"] == 4 * 131_072
    argv = scaled.command.split()
    config, _ = parse_command_line(argv[2:])
    assert config.model.rope_scale == 4 and config.data.seq_len == scaled.plan["seq_len"]
    with pytest.raises(UsageError, match="rotary"):
        plan(load_config(overrides={"model": "gpt2", "rope_scale": 2}), gpu="h100", maximize="seq-len")


def test_a_quantized_base_is_scaled_once(tmp_path):
    """QLoRA on a model built from a config saves it and loads it back quantized: the saved config is scaled already."""
    pytest.importorskip("bitsandbytes")
    from memfit.techniques.lora import quantization_config

    config = load_config(overrides=dict(model="tiny", lora_r=4, quantize="4bit", rope_scale=2, rope_scaling="linear",
                                        output_dir=str(tmp_path / "out")))
    loaded = load_model_and_tokenizer(config, torch.device("cpu"), SDPA, quantization_config(config.lora, torch.float32))
    assert loaded.max_positions == 2048 and loaded.model.config.rope_parameters["factor"] == 2.0
    from memfit.models.tiny import tiny_config

    reference = tiny_config(max_positions=2048)
    reference.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](reference)
    torch.testing.assert_close(loaded.model.model.rotary_emb.inv_freq.cpu(), inv_freq, atol=0, rtol=0)

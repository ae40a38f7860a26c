"""`memfit merge` and `memfit generate` on real runs of a tiny saved Llama (the first one resumed from a checkpoint).

The merged model is checked against PEFT's own adapter model built here from the saved base and
the run's final/ (not through memfit), and against the base alone, which must differ: otherwise
the adapters learned nothing and the equality would prove nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.train.inference import merge_run, open_run, prompt_ids
from memfit.train.loop import train
from memfit.train.metrics import read_metrics

INPUT = torch.tensor([[60, 124, 105, 109, 95, 115, 116, 97, 114, 116, 124, 62, 117, 115, 101, 114, 10, 72, 105, 33]])


def _lora_config(llama_dir, out, **extra):
    values = dict(
        model=str(llama_dir), dataset="builtin:chat", chat_template="chatml", seq_len=256, allow_drop=True, batch_size=4, max_steps=1,
        lora_r=8, lr=0.5, loss_chunk_size=0, output_dir=str(out), save_every=1, **SGD_NO_CLIPPING,
    )
    return load_config(overrides=values | extra)


@pytest.fixture(scope="module")
def lora_run(llama_dir, tmp_path_factory):
    """A LoRA run stopped after one step, then resumed from its checkpoint to a second."""
    out = tmp_path_factory.mktemp("lora-run")
    train(_lora_config(llama_dir, out))
    first_adapter = (out / "final" / "adapter_model.safetensors").read_bytes()
    train(_lora_config(llama_dir, out, max_steps=2, resume="auto"))
    return {"out": out, "first_adapter": first_adapter}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits.float()


def test_the_run_was_resumed(lora_run):
    starts = [r for r in read_metrics(lora_run["out"] / "metrics.jsonl") if r.get("event") == "start"]
    assert len(starts) == 2 and starts[-1]["resumed_from"]
    assert (lora_run["out"] / "final" / "adapter_model.safetensors").read_bytes() != lora_run["first_adapter"]


def test_merged_model_gives_the_adapter_models_logits(lora_run, llama_dir, warm_memfit, tmp_path):
    target = tmp_path / "merged"
    result = warm_memfit.run("merge", lora_run["out"], "--output", target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(target)
    assert "merged into" in result.stderr
    assert (target / "model.safetensors").is_file() and not (target / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                                        lora_run["out"] / "final")
    expected = _logits(adapter)
    torch.testing.assert_close(_logits(merged), expected, atol=1e-5, rtol=0)
    # The twin: the base alone is far from it, so the adapters moved the logits and the check has power.
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert float((_logits(base) - expected).abs().max()) > 1e-3
    # The tokenizer, its chat template included, travels with the merged model.
    assert AutoTokenizer.from_pretrained(target).chat_template


def test_qlora_run_merges_into_the_unquantized_base(llama_dir, tmp_path, warm_memfit):
    out = tmp_path / "qlora"
    train(_lora_config(llama_dir, out, quantize="4bit", lr=2.0))
    result = warm_memfit.run("merge", out)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("memfit merge:")]
    assert len(notes) == 1 and "4bit base" in notes[0] and "unquantized base" in notes[0]
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    assert not hasattr(merged.config, "quantization_config")
    unquantized = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    expected = _logits(PeftModel.from_pretrained(unquantized, out / "final"))
    torch.testing.assert_close(_logits(merged), expected, atol=1e-5, rtol=0)
    assert float((_logits(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)) - expected).abs().max()) > 1e-4


def test_merge_library_default_directory(lora_run):
    result = merge_run(open_run(lora_run["out"]))
    assert result.directory == lora_run["out"] / "merged"
    assert json.loads((result.directory / "config.json").read_text())["use_cache"] is True


def test_generation_with_a_seed_is_reproducible(lora_run, warm_memfit):
    args = ("generate", lora_run["out"], "--prompt", "Hello there", "--max-new-tokens", "24", "--temperature", "1.0")
    first = warm_memfit.run(*args, "--seed", "3")
    again = warm_memfit.run(*args, "--seed", "3")
    other = warm_memfit.run(*args, "--seed", "4")
    assert first.returncode == again.returncode == other.returncode == 0, first.stderr
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout  # the seed is what fixes it: a different one samples differently


def test_generation_renders_through_the_runs_chat_template(lora_run, tmp_path, warm_memfit):
    tokenizer = AutoTokenizer.from_pretrained(lora_run["out"] / "final")
    ids, rendered = prompt_ids(tokenizer, messages=[{"role": "user", "content": "Hi!"}])
    assert rendered
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    conversation = tmp_path / "chat.json"
    conversation.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi!"}]}))
    result = warm_memfit.run("generate", lora_run["out"], "--messages", conversation, "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr


def test_incomplete_run_directories_are_refused_in_one_line(tmp_path, warm_memfit, lora_run):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text('{"event": "start"}\n')
    cases = [
        ("merge", unfinished), ("generate", unfinished, "--prompt", "x"), ("merge", tmp_path / "missing"),
        ("merge", lora_run["out"], "--best"),  # trained without --save-best: no best/
    ]
    for case in cases:
        result = warm_memfit.run(*case)
        assert result.returncode == 2, (case, result.stderr)
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in unfinished.iterdir()) == ["metrics.jsonl"]  # nothing written


def test_generate_respects_the_memory_cap(lora_run, warm_memfit):
    result = warm_memfit.run("generate", lora_run["out"], "--prompt", "x", "--memory-cap", "64KiB")
    assert result.returncode == 3, result.stderr
    assert "--memory-cap" in result.stderr and "Traceback" not in result.stderr


def test_full_training_run_generates_and_has_nothing_to_merge(llama_dir, text_file, tmp_path, warm_memfit):
    out = tmp_path / "full"
    train(load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=2,
                                     max_steps=1, output_dir=str(out), **SGD_NO_CLIPPING)))
    result = warm_memfit.run("generate", out, "--prompt", "memory", "--max-new-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    merged = warm_memfit.run("merge", out)
    assert merged.returncode == 2 and "nothing to merge" in merged.stderr
    assert not (out / "merged").exists()

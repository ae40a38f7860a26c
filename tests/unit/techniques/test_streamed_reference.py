"""`--reference host-copy` (techniques/streamed_reference.py): the frozen copy in host memory, one unit on the device.

The streamed copy gives the whole copy's reference log-probabilities exactly (the same weights, the same kernels)
and `memfit train --task dpo` reaches the same weights with either (SGD, no clipping). The tracker sees the saving:
the step's peak falls by the copy's bytes less about one unit. The estimate counts a unit beside the reference's
forward and the copy in host memory, within 5 % of the tracked peak. Sharded engines are refused in one line, and
auto never picks it.
"""

from __future__ import annotations

import json

import pytest
import torch

from fault_injection import SGD_NO_CLIPPING, final_weights, largest_update
from memfit.config_loading import load_config
from memfit.config_sections import REFERENCE_MODES
from memfit.errors import UsageError
from memfit.prediction.estimator import estimate, resolve_run
from memfit.prediction.traced import StepSetup
from memfit.tasks import build_task
from memfit.techniques.host_memory import is_host_tensor
from memfit.techniques.reference_model import choose_reference, copy_logprobs, frozen_copy
from memfit.techniques.sequence_logprobs import sequence_logprobs
from memfit.techniques.streamed_reference import host_copy_problem, reference_pass, streamed_copy
from memfit.train.traced import measure_step_with_tracker
from tiny_llama import tiny_llama, tiny_llama_config

PAIRS = [("Hi?", "Hello there!", "Go away."), ("Name a colour.", "Blue.", "Loud."),
         ("Two and two?", "Four.", "Five, or maybe six."), ("Say yes.", "Yes.", "No.")]
DEEP = dict(hidden=64, layers=6, vocab=256, intermediate=256)
"""Six blocks of 0.2 MiB: the whole copy (1.3 MiB) dwarfs one unit, and the step takes a fraction of a second."""


def _config(**changes):
    return load_config(overrides={"seq_len": 64, "batch_size": 2, **changes})


# ---------------------------------------------------------------- the numbers


@pytest.mark.parametrize("tied", [False, True])
def test_the_streamed_copy_gives_the_whole_copys_log_probabilities_exactly(tied):
    model = tiny_llama(**DEEP, tie_word_embeddings=tied)
    whole, _ = frozen_copy(model)
    streamed, stream = streamed_copy(model)
    assert all(is_host_tensor(parameter) for parameter in streamed.parameters())  # filed as host memory
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt, not scored
    expected = copy_logprobs(whole, ids, labels, None, 16)
    assert torch.equal(copy_logprobs(streamed, ids, labels, None, 16), expected)
    with torch.no_grad(), reference_pass(streamed):  # GRPO's per-token call
        per_token = sequence_logprobs(streamed, ids, labels, None, chunk_size=16, per_token=True).per_token
    with torch.no_grad():
        assert torch.equal(per_token, sequence_logprobs(whole, ids, labels, None, chunk_size=16,
                                                        per_token=True).per_token)
    # after each pass every unit is back in host memory, the head too (held across its chunks only)
    assert stream.held is None and all(is_host_tensor(parameter) for parameter in streamed.parameters())
    assert stream.passes == 2 and stream.streamer.streamed_bytes > 2 * stream.host_bytes - 1
    units = [layer.nbytes for layer in stream.streamer.layers]
    assert len(units) == DEEP["layers"] + 3  # embedding, blocks, final norm, head
    assert stream.device_peak_bytes == max(units) + stream.resident_bytes
    with pytest.raises(RuntimeError, match="no_grad"):
        streamed(ids)


def _train_config(model_dir, data, out, reference, task, layout):
    return load_config(overrides=dict(model=str(model_dir), dataset=str(data), chat_template="chatml", task=task,
                                      seq_len=96, batch_size=4, max_steps=3, output_dir=str(out), lr=0.1, beta=0.5,
                                      report=False, reference=reference, pair_layout=layout, **SGD_NO_CLIPPING))


@pytest.mark.parametrize(("task", "layout"), [("dpo", "two-rows"), ("dpo", "shared-prompt"), ("kto", "two-rows")])
def test_training_with_the_host_copy_reaches_the_whole_copys_weights(llama_dir, tmp_path, task, layout):
    """Three SGD steps without clipping: a reference of any other value moves the weights elsewhere."""
    from memfit.train.loop import train

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}],
                                        "chosen": [{"role": "assistant", "content": c}],
                                        "rejected": [{"role": "assistant", "content": r}]}) + "\n"
                            for p, c, r in PAIRS))
    whole = final_weights(train(_train_config(llama_dir, data, tmp_path / "copy", "copy", task, layout)))
    result = train(_train_config(llama_dir, data, tmp_path / "host", "host-copy", task, layout))
    streamed = final_weights(result)
    from safetensors.torch import load_file

    start = load_file(str(llama_dir / "model.safetensors"))
    assert largest_update({name: start[name] for name in whole}, whole) > 1e-3  # far beyond the tolerance
    for name, tensor in whole.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=name)
    records = [json.loads(line) for line in (tmp_path / "host" / "metrics.jsonl").read_text().splitlines()]
    facts = next(r["task"]["reference"] for r in records if "task" in r)
    summary = [r["task"]["reference"] for r in records if "task" in r][-1]
    assert facts["mode"] == "host-copy" and facts["host_bytes"] > 2 * facts["device_peak_bytes"]
    if task == "dpo":  # the layout asked for is the one that ran (the shared prompt: one row a pair, a 4D mask)
        assert next(r["task"]["pair_layout"]["layout"] for r in records if "task" in r) == layout
    assert summary["passes"] == 3 and summary["seconds_per_pass"] > 0  # each micro-batch's streamed pass, timed
    # three steps of one micro-batch each: a step's time is its pass's
    assert summary["seconds_per_step"] == pytest.approx(summary["seconds_per_pass"], rel=1e-3)


TOKEN_VALUE = """
def token_value(completions, completion_ids=None, **kwargs):
    return [sum(token % 10 for token in ids) / (10 * max(1, len(ids))) for ids in completion_ids]
"""


def test_grpo_with_a_kl_term_and_the_host_copy_reaches_the_whole_copys_weights(llama_dir, tmp_path):
    """--beta > 0: each rollout's reference log-probabilities come from the streamed copy; the KL term's gradient
    (nonzero once the policy has moved) reaches the same weights as with the whole copy."""
    from memfit.train.loop import train

    rewards = tmp_path / "rewards.py"
    rewards.write_text(TOKEN_VALUE)

    def run(reference):
        out = tmp_path / reference
        return train(load_config(overrides=dict(
            model=str(llama_dir), task="grpo", chat_template="chatml", reward_function=f"{rewards}:token_value",
            num_generations=2, max_completion_length=6, batch_size=4, max_steps=3, output_dir=str(out), lr=0.5,
            beta=0.5, reference=reference, report=False, cache_dir=str(out / "cache"), **SGD_NO_CLIPPING)))

    whole, streamed = final_weights(run("copy")), final_weights(run("host-copy"))
    for name, tensor in whole.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=name)
    records = [json.loads(line) for line in (tmp_path / "host-copy" / "metrics.jsonl").read_text().splitlines()]
    summary = [r["task"]["reference"] for r in records if "task" in r][-1]
    assert summary["mode"] == "host-copy" and summary["passes"] == 3  # one streamed pass a rollout
    assert summary["seconds_per_step"] == pytest.approx(summary["seconds_per_pass"], rel=1e-3)
    kls = [r["kl"] for r in records if r.get("event") is None and "kl" in r]
    assert max(kls) > 0  # the reference was read, and differed from the policy


# ---------------------------------------------------------------- the memory, measured and estimated


def _measured(reference: str, shape: dict) -> int:
    hf_config, config = tiny_llama_config(**shape), _config(task="dpo", reference=reference)
    run = resolve_run(config, hf_config, None)
    setup = StepSetup(config.training.batch_size, config.data.seq_len, torch.float32, None, run.attention,
                      run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
    return measure_step_with_tracker(hf_config, config, setup)


def test_the_tracked_peak_falls_by_the_copy_less_about_one_unit_and_the_estimate_follows():
    whole_peak, streamed_peak = _measured("copy", DEEP), _measured("host-copy", DEEP)
    copy_bytes = sum(p.numel() * 4 for p in tiny_llama(**DEEP).parameters())
    _, stream = streamed_copy(tiny_llama(**DEEP))
    saved = whole_peak - streamed_peak
    print(f"copy {whole_peak / 2**20:.3f} MiB, host-copy {streamed_peak / 2**20:.3f} MiB, saved {saved / 2**20:.3f}"
          f" of a {copy_bytes / 2**20:.3f} MiB copy (a unit: {stream.device_peak_bytes / 2**20:.3f} MiB)")
    assert copy_bytes - 2 * stream.device_peak_bytes <= saved <= copy_bytes
    result = estimate(_config(task="dpo", reference="host-copy"), hf_config=tiny_llama_config(**DEEP))
    print(f"estimated {result.peak_bytes / 2**20:.3f} MiB ({result.peak_bytes / streamed_peak - 1:+.2%})")
    assert abs(result.peak_bytes / streamed_peak - 1) <= 0.05
    facts = result.details["preference"]
    assert facts["reference"] == "host-copy" and facts["reference_copy_bytes"] == 0
    assert facts["reference_host_bytes"] == copy_bytes and result.host_breakdown["reference"] == copy_bytes
    assert 0 < facts["reference_streamed_bytes"] <= stream.device_peak_bytes


# ---------------------------------------------------------------- where it cannot run, and auto


@pytest.mark.parametrize(("flags", "engine"), [({"sharding": "fsdp"}, "--sharding fsdp"),
                                               ({"zero_stage": 3}, "DeepSpeed ZeRO-3")])
def test_sharded_engines_are_refused_in_one_line_naming_what_to_use(flags, engine):
    config = _config(task="dpo", reference="host-copy", **flags)
    with pytest.raises(UsageError) as refused:
        build_task(config)
    message = str(refused.value)
    assert engine in message and "use --reference copy" in message and "\n" not in message
    assert host_copy_problem(_config(zero_stage=2).distributed) == ""


def test_auto_never_picks_the_host_copy():
    for lora in (False, True):
        assert choose_reference("auto", False, lora, True).mode != "host-copy"
        assert choose_reference("host-copy", False, lora, True).mode == "host-copy"
    assert "host-copy" in REFERENCE_MODES  # a choice of --reference, shown in its help


@pytest.mark.gpu
def test_on_cuda_the_copy_is_pinned_the_next_unit_prefetched_and_the_allocator_holds_about_two_units():
    """The CUDA path: pinned host weights, the side stream's prefetch, the whole copy's numbers, and
    `max_memory_allocated` during a streamed pass above the policy's by about two units, not the copy."""
    device = torch.device("cuda")
    model = tiny_llama(**DEEP).to(device)
    whole, copy_bytes = frozen_copy(model)
    streamed, stream = streamed_copy(model)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in streamed.parameters())
    assert stream.streamer.side is not None and stream.facts()["prefetch"]
    ids = torch.randint(0, 256, (3, 40), device=device, generator=torch.Generator(device).manual_seed(0))
    expected = copy_logprobs(whole, ids, ids, None, 16)
    del whole
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert torch.equal(copy_logprobs(streamed, ids, ids, None, 16), expected)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    units = sorted(layer.nbytes for layer in stream.streamer.layers)
    assert units[-1] <= extra < copy_bytes  # the running unit at least, never the whole copy's weights
    assert stream.facts()["seconds"] > 0 and stream.held is None

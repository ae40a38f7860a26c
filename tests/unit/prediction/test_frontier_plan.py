"""The 8B full fine-tune frontier: the plan of `memfit plan --model llama-3.1-8b --gpu rtx-4090 --allow full --seq-len
2048 --batch-size 2`, the estimate it rests on measured by the tracker at 1/1024 scale, and which limit stops a plan
that does not fit."""

from __future__ import annotations

import random

import pytest

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError
from memfit.gpus import GpuSpec
from memfit.models import optimizer_state
from memfit.prediction.estimate_result import CUDA_CONTEXT_BYTES
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import plan
from memfit.units import GIB, MIB

TORCHTUNE_PEAK = 18.9 * GIB
"""torchtune's Llama-3.1-8B full fine-tune on one RTX 4090 (paged 8-bit AdamW in backward), from its README."""
FRONTIER = {"model": "llama-3.1-8b", "seq_len": 2048, "batch_size": 2}


@pytest.fixture(scope="module")
def frontier():
    # the machine: 24 GiB of RAM, no --host-memory
    return plan(load_config(overrides=FRONTIER), gpu="rtx-4090", allow="full", host_memory=24 * GIB)


def test_the_frontier_plan_pages_nothing_and_allocates_less_than_torchtune(frontier):
    chosen = frontier.plan
    assert chosen["lora_r"] == 0 and chosen["optimizer"] not in ("paged-adamw-8bit", "adamw-8bit", "adamw")
    assert chosen["optimizer_in_backward"] and chosen["activation_offload"]
    est = estimate(load_config(overrides={**FRONTIER, **{k: v for k, v in chosen.items() if k != "seq_len"}}),
                   gpu="rtx-4090")
    assert est.peak_bytes == frontier.estimated_peak_bytes
    assert est.host_breakdown.get("optimizer_states", 0) == 0  # no optimizer state in host memory
    # the tensors alive at the peak (what torch.cuda.max_memory_allocated counts) stay under torchtune's figure;
    # memfit's device peak adds the CUDA context and the allocator's slack to them
    assert est.details["allocated_peak_bytes"] < TORCHTUNE_PEAK
    # what bounds it: the weights and one head-sized gradient with every checkpoint offloaded; APOLLO-Mini's step
    # scales the head's gradient a block at a time (apollo-torch's own step adds two head-sized temporaries, 1.96
    # GiB, which would fail this), and the loss chunks add no head-sized sums (accumulated in place)
    head = 128256 * 4096 * 2
    assert est.details["allocated_peak_bytes"] < est.breakdown["parameters"] + head + 0.6 * GIB
    assert est.breakdown["gradients"] < 1.5 * head
    # with the CUDA context measured on an H100 (0.85 GiB) and 5 % slack, the device peak too
    assert frontier.estimated_peak_bytes < TORCHTUNE_PEAK
    compared = [line for line in frontier.trades if line.startswith("nothing paged to the host")]
    assert compared and float(compared[0].split("expected ")[1].split("x")[0]) > 1.1


def test_the_frontier_plan_names_its_allocated_peak(frontier):
    lines = [line for line in frontier.trades if "allocated" in line and "CUDA context" in line]
    assert lines and f"{frontier.estimated_peak_bytes / GIB:.2f} GiB" in lines[0]


@pytest.mark.slow
def test_the_frontier_estimate_follows_the_tracker_at_1_1024_scale(tmp_path, monkeypatch):
    """Llama-3.1-8B's shape at 1/1024 of its bytes: what the estimate puts at the peak is what the tracker finds.

    Width 128, 32 blocks, a 4008-token vocabulary and 128 tokens a step keep the 8B run's proportions (checkpoints,
    head, recomputed block), so the parts come out in MiB where the 8B run's are in GiB. Before the estimate knew that
    a checkpointed block keeps one residual-stream tensor and that the head is stepped before any block is
    recomputed, it was 8 % over (20.95 MiB against 19.34 tracked).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer
    from memfit.train.profiling import profile_run

    shape = LlamaConfig(vocab_size=4008, hidden_size=128, intermediate_size=448, num_hidden_layers=32,
                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                        eos_token_id=256, pad_token_id=256, bos_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(shape).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    words = "memory gradient batch token model layer the a of to in training fits device loss step".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(200)) for _ in range(20)))
    config = load_config(overrides={
        "model": str(tmp_path / "model"), "dataset": str(corpus), "batch_size": 2, "seq_len": 64, "max_steps": 2,
        "log_every": 1000, "output_dir": str(tmp_path / "run"), "report": False, "dtype": "bf16",
        "gradient_checkpointing": "full", "optimizer": "apollo-mini", "optim_target_modules": "all",
        "loss_chunk_size": 32, "optimizer_in_backward": True, "max_grad_norm": 0.0})
    # APOLLO's step scales the gradient in blocks (8 MiB in bf16): 1/1024 of them too
    monkeypatch.setattr(optimizer_state, "APOLLO_BLOCK_ELEMENTS", optimizer_state.APOLLO_BLOCK_ELEMENTS // 1024)
    est = estimate(config)
    tracked = profile_run(config)[0].to_dict()
    print(f"tracked {tracked['peak_bytes'] / MIB:.2f} MiB {tracked['breakdown']}, estimated {est.peak_bytes / MIB:.2f}"
          f" MiB {est.breakdown}")
    assert abs(est.peak_bytes / tracked["peak_bytes"] - 1) < 0.03
    # one residual-stream tensor per checkpointed block (two would be 1 MiB more)
    assert abs(est.breakdown["activations"] - tracked["breakdown"]["activations"]) < 0.15 * MIB
    assert est.breakdown["recomputed_activations"] == 0  # the head's step, before any block is recomputed


@pytest.mark.slow
def test_a_plan_stopped_by_host_memory_says_so_and_names_the_flag():
    """The device fits only with offloaded activations, which need more host memory than --host-memory allows."""
    config = load_config(overrides={"model": "tiny", "seq_len": 16384, "batch_size": 1})
    # the CUDA context and 260 MiB: the tiny model's 16K-token step fits only with its checkpoints offloaded
    gpu = GpuSpec("small-test", CUDA_CONTEXT_BYTES + 260 * MIB, True, 100.0, 100.0, 32.0)
    assert plan(config, gpu=gpu, allow="full", host_memory=4 * GIB, explain=False).host_bytes > 0
    with pytest.raises(DoesNotFitError, match=r"^host memory stopped it: .* need at least \d+\.\d GiB of host memory"
                       r" .* over the \d+\.\d GiB planned .*--host-memory") as error:
        plan(config, gpu=gpu, allow="full", host_memory=4 * MIB)
    assert "device memory stopped it" not in str(error.value)


def test_a_plan_stopped_by_device_memory_says_so_and_names_the_flag():
    config = load_config(overrides={"model": "tiny", "seq_len": 256})
    with pytest.raises(DoesNotFitError, match=r"^device memory stopped it: needs \d+\.\d GiB with everything on,"
                       r" \d+\.\d GiB over the --memory-budget .*\(--gpu / --memory-budget set it\)"):
        plan(config, budget_bytes=1 * MIB, host_memory=64 * GIB)

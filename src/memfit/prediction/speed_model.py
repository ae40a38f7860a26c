"""How long one training step takes, predicted: the speed model the planner ranks configurations by.

`estimated_step_seconds` turns a configuration into seconds from the hardware FLOPs it runs
(`memfit.models.flops`), the device's rate and the costs that FLOPs do not show (small
micro-batches, 8-bit optimizer state on a CPU, the chunked loss, compiled blocks, host
transfers). Each constant below cites the measurement it comes from; every training run
logs this prediction beside the measured step time, so the model is checked on every run.
"""

from __future__ import annotations

from typing import Any

from memfit.config import SMALL_STATE_OPTIMIZERS, TrainConfig
from memfit.gpus import GpuSpec
from memfit.prediction.context_parallel import ulysses_seconds
from memfit.prediction.estimate_result import Estimate
from memfit.prediction.rl_speed import RLStepSeconds
from memfit.prediction.rl_step import is_rl
from memfit.resolution.registry import speed_terms
from memfit.resolution.resolve import resolve
from memfit.techniques.resolved_run import ResolvedRun
from memfit.techniques.technique import SpeedFacts

UTILISATION = 0.45
"""Fraction of the GPU's peak rate a well-fed training step reaches."""
CPU_PROBE_UTILISATION = 0.7
"""Fraction of the matmul probe's rate (`memfit.models.flops.probe_matmul_flops`) a CPU training step reaches.

benchmarks/bench_planned_vs_trainer.py (6.5M-parameter Llama, seq 512, 8 samples per step, fp32, 2-core AMD
EPYC, AVX2, 2 threads, quiet, 2026-11-26): micro-batch 2 x 4 ran at 91.5 GFLOP/s against a probe of 129.7
(0.71) with the default ISA, 74.4 against 110.9 (0.67) under ATEN_CPU_CAPABILITY=default. The GPU's 0.45 had
trials predict 3.85 s/step where 2.28 s was measured (the cost of trials against the run misjudged with it);
rankings are unchanged.
"""
NOMINAL_TFLOPS = 100.0
"""Rate assumed without a GPU preset: only relative speeds are meaningful then."""
FEEDING_TOKENS = {"cuda": 512, "cpu": 80}
"""Tokens per micro-batch at which a step runs at half its full rate (`tokens / (tokens + this)`).

On a GPU a small micro-batch leaves it idle between small kernels. A CPU has no launch
latency to hide and loses much less: with benchmarks/bench_speed_ranking.py (22.9M-parameter
Llama, seq 128, CPU, 2 cores, one thread, 2026-11-23) micro-batch 1 x 4 ran at 0.56 to 0.83x
of 4 x 1 over six paired configurations (median 0.72), which 80 tokens reproduces (0.71x);
the GPU figure of 512 predicted 0.40x there.
"""
OPTIMIZER_STEP_FLOPS = {("cpu", "8bit"): 1300.0}
"""Extra cost of one optimizer step per trainable parameter over AdamW, in FLOPs at the step's matmul rate.

8-bit AdamW on a CPU dequantizes and requantizes its state element by element in the
bitsandbytes CPU code: benchmarks/bench_speed_ranking.py (22.9M-parameter Llama, seq 128,
CPU, 2 cores, one thread, 2026-11-23) measured it at 0.73x of AdamW without checkpointing
and 0.74x with full checkpointing; 1300 FLOPs per parameter gives 0.74x and 0.75x (the
planner's former `x 1.01` predicted 0.99x). On a GPU its fused kernel is about as fast as
AdamW's (not measured by memfit): a 1 % tie-break there keeps plain AdamW first where both fit.
"""
CHUNKED_LOSS_COST = {("cpu", "fp32"): 1.2, ("cpu", "bf16"): 0.7}
"""How much its recomputed head costs against its FLOPs, by device and compute dtype (1 where absent).

fp32 on a CPU: the per-chunk checkpoint and fp32 projection are partly memory-bound: same
benchmark, the chunked loss ran at 0.67 to 0.88x of full logits over six paired
configurations (median 0.83, 0.74x for the plain one) against 0.85 to 0.87x from its FLOPs
alone; 1.2x its FLOPs gives 0.82 to 0.84x.

bf16 autocast on a CPU with bf16 matrix units (AMX): the matmuls run several times faster
than the element-wise work around them (the fp32 log-softmax over the logits, casts), which
dominates the step, so recomputing the head costs a small part of what its FLOPs say.
benchmarks/bench_p2_settings.py (22.9M-parameter Llama, seq 512, micro-batch 4, bf16
autocast, CPU, 2 cores with AMX, one thread, tokens per CPU second against a paired
reference, one pass each, 2026-11-23): chunks of 256 tokens ran at 0.90x of full logits,
chunks of 1024 at 0.84x, chunks of 256 with the optimizer in backward at 1.01x (noise of
about 10 % on that shared machine; compiled, 256-token chunks at 0.97x); 0.7x its FLOPs
gives 0.90x. The fp32 figure of 1.2 predicted 0.84x and put micro-batch 1 x 4 with full
logits 7 % ahead of 4 x 1 with chunks; this puts them even, where 4 x 1 chunked ran 8 %
faster (1.22x and 1.13x the Trainer's 1 x 4): the model's remaining error.
Not measured on a GPU.
"""
SELECTIVE_DISPATCH_CPU_FLOPS = 1.25e9
"""What selective checkpointing costs a CPU step per checkpointed block and micro-batch beyond its FLOPs, in FLOPs
at the step's matmul rate.

torch keeps the matmul and attention outputs through a Python dispatch mode that sees every operator of the
block's forward and again of its recompute, whatever its size; with a small model on a CPU that time, not the 5 %
of the block's FLOPs selective redoes (memfit.models.flops), is its cost, and it grows with the micro-batches
(each runs every block again), not with their tokens. Profiled (torch.profiler, the model of the benchmark named next, seq 128,
micro-batch 2, one thread): 575 ms of operators without checkpointing, 957 with selective (184 ms of it in the
dispatch mode itself, 1,360 operators seen), 694 with full checkpointing. The trials of
benchmarks/bench_planned_vs_trainer.py (6.5M-parameter Llama, 8 blocks of width 256, seq 512, fp32, 2-core AMD
EPYC, 2 threads, four runs of 2026-11-26 on both ISAs, 16 pairs): at the same micro-batch selective ran 0.93 to
1.94x the step without checkpointing (median 1.27; without this term the model said 1.015), -0.5 to 3.0 GFLOPs
more per block and micro-batch at that step's rate (median 1.26). Not measured on a GPU, where the dispatch runs
ahead of the kernels: not counted there.
"""
SMALL_CHUNK_COST = 0.01
"""Extra step time of a loss chunk of 256 tokens over one of 1024 (a tie-break, as a fraction).

The planner tries chunks of 256 tokens where chunks of 1024 do not fit (a vocabulary of
32000 makes a 1024-token chunk's fp32 logits 125 MiB). benchmarks/bench_p2_settings.py
measured no cost beyond its noise (4 x 1 at seq 512, bf16 autocast: 256-token chunks at
0.90x of full logits, 1024-token chunks at 0.84x, one pass each); the 1 % keeps the larger
chunk where both fit, so plans that fitted before do not change.
"""
COMPILED_BLOCKS_SPEEDUP = {"cpu": 1.14}
"""How much faster a step runs with `--compile` (the blocks compiled), by device; absent: not planned.

Inductor fuses each block's element-wise work (norms, rotary embedding, SiLU, residual adds,
autocast casts), which on a CPU with bf16 matrix units is most of a small model's block time.
benchmarks/bench_p2_settings.py (22.9M-parameter Llama, seq 512, bf16 autocast, CPU, 2 cores,
one thread, tokens per CPU second against a paired reference, medians of one to four runs,
2026-11-23), compiled over eager at the same setting: micro-batch 1 x 4 1.07x; 4 x 1 with
full logits 1.08x, with 256-token loss chunks 1.17x, and the optimizer in backward 1.14x, and
full checkpointing 1.19x. 1.14 is their median (an earlier fp32 run at seq 128, benchmarks.md,
"Speed model": 1.24x). One factor misses that larger micro-batches gain more. The first
step's compile time (tens of seconds on a CPU) is not in a step's time. Not measured on a
GPU, so not planned there.
"""


def compute_dtype(changes: dict[str, Any], config: TrainConfig, device: str) -> str:
    """'bf16' when the step's matmuls run in bf16 (autocast or bf16 weights), else 'fp32' (fp16 counts as bf16)."""
    precision = changes.get("precision", config.memory.precision)
    dtype = changes.get("dtype", config.model.dtype)
    if dtype in ("bf16", "fp16") or precision in ("amp", "bf16", "fp16"):
        return "bf16"
    return "bf16" if precision == "auto" and device == "cuda" else "fp32"


COMPILE_PAYS_AFTER_FLOPS = {"cpu": 4.9e13}
"""Training FLOPs of a run below which `--compile` costs more time than it saves, by device.

Compiling one block takes about 40 s on a busy 2-core CPU with a cold cache (the first
step; docs/speed.md); at the gain of COMPILED_BLOCKS_SPEEDUP (1 - 1/1.14 = 12 % of each
step) that is repaid after about 325 s of eager training, which at the rate
bench_p2_settings.py measured (1000 tokens per CPU second at 151 MFLOPs per token, bf16
autocast, one thread) is 4.9e13 FLOPs: about 160 steps of 4 x 512 tokens of its 22.9M
model, never a smoke run of the tiny model.
"""


def compile_planned(device: str, config: TrainConfig, hf_config: Any = None) -> bool:
    """Whether the planner should plan `--compile`: its gain is measured on this device, the run
    is long enough to repay the compile time (COMPILE_PAYS_AFTER_FLOPS) and compile can run here.

    A run of --epochs counts as long (its length is not known before the data is read);
    without the model's config the length is unknown and compile is not planned.
    """
    if device not in COMPILED_BLOCKS_SPEEDUP or hf_config is None:
        return False
    if config.training.epochs is None:
        from memfit.models.flops import flops_per_token
        seq = config.data.seq_len_or_default
        tokens = config.training.max_steps * config.effective_batch_for(1) * seq
        threshold = compile_pays_after_flops(device) or COMPILE_PAYS_AFTER_FLOPS[device]  # measured here, else ours
        if tokens * flops_per_token(hf_config, seq).model < threshold:
            return False
    import torch

    from memfit.techniques.compile import compile_unavailable_reason

    return not compile_unavailable_reason(torch.device(device))


def estimated_step_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, gpu: GpuSpec | None,
                           hf_config: Any, *, device: str | None = None, calibrate: bool = True) -> float:
    """Seconds of one optimizer step: FLOPs over the device's rate, plus host transfers.

    Training FLOPs are the hardware FLOPs of `memfit.models.flops.flops_per_token`: every
    matmul forward and backward (LoRA: no weight gradients for the frozen base), attention,
    and what is recomputed (the checkpointed blocks' forward, the head again with chunked
    loss), + one MLP forward per step with tiled MLP, QLoRA dequantization +25 %. Small
    micro-batches use the device less well (FEEDING_TOKENS), 8-bit AdamW costs extra per
    parameter on a CPU (OPTIMIZER_STEP_FLOPS), and the chunked loss more than its FLOPs
    there (CHUNKED_LOSS_COST), selective checkpointing its operator dispatch per block and
    micro-batch there (SELECTIVE_DISPATCH_CPU_FLOPS), and `--compile` divides the compute time by its measured gain
    (COMPILED_BLOCKS_SPEEDUP; `changes["compile"]`, else the config's). What a technique adds
    by itself (activation offload, optimizer offload, streamed experts, paged state: host
    transfers, in full at the host link's rate, an upper bound since their copies overlap
    compute; a registered technique's own cost) is its TECHNIQUE's speed terms, read from the
    run `changes` resolve to (`timed_run`, `memfit.resolution.registry.speed_terms`).
    Under --context-parallel N each rank computes 1/N of the step and adds Ulysses' all-to-all
    traffic at its link's rate (`memfit.prediction.context_parallel.ulysses_seconds`).

    `device` is "cpu" or "cuda"; by default "cpu" without a GPU preset (a plan with only a
    memory budget runs where memory is the host's), "cuda" with one.

    --task grpo adds generating and scoring its completions (`rl_step_seconds`).

    Planning for this machine's CPU (no GPU preset), the seconds are multiplied by what this
    device measured (`memfit.prediction.calibration`: trials and planned runs); `calibrate=False`
    gives the model's own figure.
    """
    if is_rl(config):  # --task grpo: its generation and scoring beside the training pass
        return rl_step_seconds(changes, config, est, gpu, hf_config, device=device, calibrate=calibrate).total
    device = device or ("cpu" if gpu is None else "cuda")
    compute = compute_dtype(changes, config, device)
    seconds = _trained_step_seconds(changes, config, est, gpu, hf_config, device, compute, _rate(gpu))
    if calibrate and gpu is None and device == "cpu":  # measured here: the CPU that plans is the one that trains
        from memfit.prediction.calibration import correction

        seconds *= correction(changes, config, device, compute)
    return seconds


def rl_step_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, gpu: GpuSpec | None,
                    hf_config: Any, *, device: str | None = None, calibrate: bool = True) -> RLStepSeconds:
    """A --task grpo step's seconds split into generation, scoring and training (prediction/rl_speed.py), each
    calibrated as `estimated_step_seconds` is."""
    from memfit.prediction.rl_speed import rl_training_changes, rollout_seconds

    device = device or ("cpu" if gpu is None else "cuda")
    compute = compute_dtype(changes, config, device)
    rate = _rate(gpu)
    training = _trained_step_seconds(rl_training_changes(changes, config), config, est, gpu, hf_config, device,
                                     compute, rate)
    generation, scoring = rollout_seconds(changes, config, hf_config, gpu, device, compute, rate,
                                          FEEDING_TOKENS[device])
    split = RLStepSeconds(generation, scoring, training)
    if calibrate and gpu is None and device == "cpu":
        from memfit.prediction.calibration import correction

        split = split.scaled(correction(changes, config, device, compute))
    return split


def _rate(gpu: GpuSpec | None) -> float:
    """FLOPs a second a step computes at: the GPU's peak (NOMINAL_TFLOPS without one) times UTILISATION."""
    return (gpu.peak_tflops if gpu is not None else NOMINAL_TFLOPS) * 1e12 * UTILISATION


def _trained_step_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, gpu: GpuSpec | None,
                          hf_config: Any, device: str, compute: str, rate: float) -> float:
    """The forward, backward and optimizer step over the step's rows, with context parallelism and host transfers."""
    compute_seconds = _compute_seconds(changes, config, est, hf_config, device, compute, rate)
    context = changes.get("context_parallel", config.distributed.context_parallel)
    if context > 1:  # each rank computes 1/N of every row, then waits for Ulysses' all-to-alls over the GPUs' link
        compute_seconds = compute_seconds / context + ulysses_seconds(changes, config, hf_config, gpu, compute)
    return _with_host_transfers(compute_seconds, changes, config, est, gpu, hf_config, device, compute, rate)


def _training_flops(changes: dict[str, Any], config: TrainConfig, hf_config: Any, device: str, compute: str) -> float:
    """Hardware FLOPs of one optimizer step (every micro-batch): the model's forward and backward, what is
    recomputed, the chunked loss's head beyond its FLOPs (CHUNKED_LOSS_COST), one more MLP forward with tiled MLP,
    and QLoRA's dequantization (+25 %)."""
    from memfit.models.flops import flops_per_token
    from memfit.prediction.activations import architecture_of

    arch = architecture_of(hf_config)
    seq = changes.get("seq_len", config.data.seq_len_or_default)
    micro = changes.get("batch_size", config.training.batch_size)
    tokens = micro * seq * changes.get("gradient_accumulation_steps", 1)
    chunked = bool(changes.get("loss_chunk_size", 0) or 0)
    per_token = flops_per_token(hf_config, seq, lora_rank=changes.get("lora_r", config.lora.lora_r),
                                checkpointing=changes.get("gradient_checkpointing", "off"), chunked_loss=chunked)
    hardware = per_token.hardware
    if chunked:
        hardware += (CHUNKED_LOSS_COST.get((device, compute), 1.0) - 1.0) * per_token.head_forward
    mlp_forward = (3 if arch.gated_mlp else 2) * 2 * arch.hidden * arch.intermediate * arch.layers
    tiled = mlp_forward if changes.get("tiled_mlp") else 0
    flops = tokens * (hardware + tiled)
    from memfit.prediction.preference_step import pair_forwards_again

    flops += tokens * per_token.forward * pair_forwards_again(changes, config)  # --pair-layout split's second forward
    if changes.get("quantize", "none") == "4bit":
        flops *= 1.25
    return flops


def _compute_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, hf_config: Any, device: str,
                     compute: str, rate: float) -> float:
    """Seconds the device computes one optimizer step: its FLOPs at the rate its micro-batches feed it, what small
    loss chunks and selective checkpointing's dispatch cost beyond FLOPs, compiled blocks' gain, and the
    optimizer's own step."""
    seq = changes.get("seq_len", config.data.seq_len_or_default)
    micro = changes.get("batch_size", config.training.batch_size)
    accumulation = changes.get("gradient_accumulation_steps", 1)
    chunk = changes.get("loss_chunk_size", 0) or 0
    feeding = micro * seq / (micro * seq + FEEDING_TOKENS[device])
    seconds = _training_flops(changes, config, hf_config, device, compute) / (rate * feeding)
    if 1 < chunk < 1024:  # (a run's own prediction marks any chunked loss as chunk size 1)
        seconds *= 1 + SMALL_CHUNK_COST
    if device == "cpu" and str(changes.get("gradient_checkpointing", "off")).startswith("selective"):
        from memfit.prediction.activations import architecture_of
        from memfit.techniques.checkpointing import checkpointed_block_indices

        every = max(1, int(changes.get("checkpoint_every", config.memory.checkpoint_every)))
        blocks = len(checkpointed_block_indices(architecture_of(hf_config).layers, every))
        seconds += accumulation * blocks * SELECTIVE_DISPATCH_CPU_FLOPS / rate
    if changes.get("compile", config.memory.compile):
        seconds /= COMPILED_BLOCKS_SPEEDUP.get(device, 1.0)
    return _with_optimizer_step(seconds, changes, config, est, hf_config, device, rate)


def _with_optimizer_step(seconds: float, changes: dict[str, Any], config: TrainConfig, est: Estimate,
                         hf_config: Any, device: str, rate: float) -> float:
    """`seconds` with what the optimizer's step costs beyond AdamW's: 8-bit state on a CPU (a tie-break on a GPU),
    a small-state optimizer's projections, SVDs or quantization."""
    trainable = est.details["trainable_parameter_count"]
    if changes.get("optimizer", "adamw").endswith("8bit"):
        if (device, "8bit") in OPTIMIZER_STEP_FLOPS:
            seconds += trainable * OPTIMIZER_STEP_FLOPS[(device, "8bit")] / rate
        else:
            seconds *= 1.01
    if changes.get("optimizer", config.optimizer.optimizer) in SMALL_STATE_OPTIMIZERS:
        seconds += small_state_step_flops(changes, config, hf_config) / rate  # projections, SVDs, quantization
    return seconds


def _with_host_transfers(compute_seconds: float, changes: dict[str, Any], config: TrainConfig, est: Estimate,
                         gpu: GpuSpec | None, hf_config: Any, device: str, compute: str, rate: float) -> float:
    """The step's compute seconds with its host-link traffic: what each technique of the run adds (its TECHNIQUE's
    speed terms: optimizer and activation offload, streamed experts, paged optimizer state, each in full, an upper
    bound since their copies overlap compute), then the frozen-weight levers (prediction/lever_costs.py)."""
    from memfit.prediction.expert_streaming import HIDING_SHARE
    from memfit.prediction.lever_costs import lever_model_seconds  # embedding on host, NF4 head, expert groups

    micro = changes.get("batch_size", config.training.batch_size)
    seq = changes.get("seq_len", config.data.seq_len_or_default)
    link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
    facts = SpeedFacts(
        accumulation=changes.get("gradient_accumulation_steps", 1), tokens=micro * seq,
        compute_seconds=compute_seconds, overlap_seconds=HIDING_SHARE * compute_seconds, rate=rate,
        link_bytes_per_second=link, trainable_parameters=est.details["trainable_parameter_count"],
        host_optimizer_state_bytes=est.host_breakdown.get("optimizer_states", 0),
        activation_transfer_bytes=est.details.get("pcie_bytes_per_micro_batch", 0),
        expert_stream_bytes=est.details.get("expert_stream_bytes_per_micro_batch", 0))
    seconds = compute_seconds + speed_terms(timed_run(changes, config, hf_config, device, gpu), facts)
    seconds += sum(lever_model_seconds(changes, config, hf_config, device, compute, rate, link, gpu).values())
    return seconds


def timed_run(changes: dict[str, Any], config: TrainConfig, hf_config: Any, device: str,
              gpu: GpuSpec | None) -> ResolvedRun:
    """The run `changes` make of `config` on `device`, as the registry resolves it: what the techniques' speed terms
    read. It has the micro-batches per step the speed model times (`changes`, else 1), not the effective batch's."""
    timed = {"effective_batch_size": None, "gradient_accumulation_steps": 1, **changes}
    return resolve(config.replace(**timed), hf_config, device, bf16_supported=gpu.bf16 if gpu is not None else True)


def lever_step_seconds(changes: dict[str, Any], config: TrainConfig, hf_config: Any, gpu: GpuSpec | None, *,
                       device: str | None = None, calibrate: bool = True) -> dict[str, float]:
    """What each frozen-weight lever of `changes` adds to `estimated_step_seconds`, in seconds per step, calibrated
    as that is (`memfit.prediction.lever_costs`; empty where none is on)."""
    from memfit.prediction.lever_costs import lever_model_seconds

    device = device or ("cpu" if gpu is None else "cuda")
    compute = compute_dtype(changes, config, device)
    rate = (gpu.peak_tflops if gpu is not None else NOMINAL_TFLOPS) * 1e12 * UTILISATION
    link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
    costs = lever_model_seconds(changes, config, hf_config, device, compute, rate, link, gpu)
    if costs and calibrate and gpu is None and device == "cpu":
        from memfit.prediction.calibration import correction

        factor = correction(changes, config, device, compute)
        costs = {name: seconds * factor for name, seconds in costs.items()}
    return costs


def compile_pays_after_flops(device: str) -> float | None:
    """Training FLOPs after which --compile repays its compile time on this device, from what it measured
    (`calibration.compile_measured`): the compile seconds of a compiled run here, the gain compiled steps
    showed (measured, else this model's COMPILED_BLOCKS_SPEEDUP corrected by the device's compile term)
    and the device's calibrated rate. None when no compiled run was measured here; inf when compile lost."""
    import math

    from memfit.prediction.calibration import compile_measured

    measured = compile_measured(device)
    if measured is None:
        return None
    compile_seconds, gain, compile_correction, rate_correction = measured
    gain = gain or COMPILED_BLOCKS_SPEEDUP.get(device, 1.0) / compile_correction
    if gain <= 1.0:
        return math.inf  # compiled steps ran no faster here: never repaid
    rate = NOMINAL_TFLOPS * 1e12 * UTILISATION / rate_correction  # FLOPs per second measured here
    return compile_seconds * rate * gain / (gain - 1.0)


def small_state_step_flops(changes: dict[str, Any], config: TrainConfig, hf_config: Any) -> float:
    """Extra FLOPs of one step of GaLore / APOLLO / Adam-mini / 4-bit AdamW (memfit.models.optimizer_state)."""
    from dataclasses import replace

    from memfit.models.optimizer_state import projection_settings, step_extra_flops
    from memfit.models.state_bytes import parameter_inventory

    keys = ("optimizer", "optim_target_modules", "optim_rank", "optim_update_proj_gap", "optim_scale")
    optimizer = replace(config.optimizer, **{k: changes[k] for k in keys if k in changes})
    settings = projection_settings(optimizer)
    return step_extra_flops(optimizer.optimizer, parameter_inventory(hf_config).named, settings)

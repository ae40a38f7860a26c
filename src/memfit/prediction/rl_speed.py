"""How long a `--task grpo` step takes beside its training pass: generating the completions and scoring them.

A GRPO step (memfit.tasks.grpo) generates its completions, scores them without gradients (the reference's
log-probabilities under --beta > 0, the generating policy's under --num-iterations > 1), then trains on them.
`rl_step_seconds` splits the step's predicted time into those parts:

- **generation**: for each round of --generation-batch-size completions (every completion of the rank's step at
  once by default), one compute-bound forward over the prompts (prefill), then one decoding forward a completion
  token, --max-completion-length of them (the rollout stops early only when every completion of the round has ended,
  so the longest sets the count). Each forward runs at the rate its tokens feed the device
  (speed_model.FEEDING_TOKENS): a decoding forward of a few completions, one token each, uses a small share of it. A
  decoding forward also reads every weight and the cache of the tokens so far, so on a GPU it takes the longer of its
  FLOPs at that rate and those bytes at the device's memory bandwidth (memfit.gpus `memory_gbps`); an eager forward's
  kernel launches are not counted there (not measured by memfit: small models decode slower than this says). On a CPU, whose bandwidth memfit's tables do not hold, it takes its FLOPs plus the operator
  dispatch of a forward, which for the small models a CPU trains is most of a decoding step
  (DECODE_DISPATCH_CPU_FLOPS).
- **scoring**: one no-grad forward over every completion row for each set of log-probabilities kept.
- **training**: speed_model's step over rows of prompt + completion tokens (prediction/rl_step.py
  `rl_row_length`), the log-probabilities a chunk of logits at a time.

A rollout is trained on for --num-iterations steps, so its generation and scoring count 1/N to each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DECODE_FEEDING_TOKENS = {"cpu": 28}
"""Tokens at which a decoding forward runs at half the matmul rate on a CPU (`tokens / (tokens + this)`); absent:
speed_model.FEEDING_TOKENS, which training micro-batches were measured with. Fitted with DECODE_DISPATCH_CPU_FLOPS
to the measurements below (about 4.5x the FLOPs' time for 8 completions at once; training's 80 gave 11x)."""
DECODE_DISPATCH_CPU_FLOPS = 2e7
"""What one decoding forward costs a CPU per block beyond its FLOPs, in FLOPs at the step's matmul rate.

A decoding forward runs every operator of every block for one token a completion, so the operators' dispatch, not
only their arithmetic, takes a CPU's time, and its matmuls of a few rows run well below the probe's rate. Measured
with `memfit train --task grpo` (8 completions a step, generated at once, prompts of at most 48 tokens, one thread,
the fastest `generation_seconds` of steps 2 to 4, 2-core AMD EPYC dev machine at a load average of about 3.5,
2026-11-28; matmul probe 104 GFLOP/s, so a rate of 73): Llamas of width 256 with 4 blocks decoded at 3.7 ms a token,
width 256 with 8 blocks at 9.0 ms, width 512 with 4 blocks at 10.8 ms, where their FLOPs at the full rate take
0.53, 1.05 and 2.1 ms. 28 feeding tokens (4.5x the FLOPs' time) and 2e7 FLOPs (0.27 ms) a block, the head and the
draw counted as one more (DECODE_HEAD_CPU_BLOCKS), predict 1.1x, 0.9x and 1.0x of the measured ratio of generation
to the rest of the step. Under heavier load (5 to 6) the same steps took 2 to 3x as long, generation and training
alike.
"""
DECODE_HEAD_CPU_BLOCKS = 1.0
"""The final norm, the output projection and the sampler's draw of a decoding step on a CPU, in blocks' dispatch."""


@dataclass(frozen=True)
class RLStepSeconds:
    """One GRPO step's predicted seconds, by phase (before the device's calibration)."""

    generation: float
    """Generating the step's completions (a rollout's share: divided by --num-iterations)."""
    scoring: float
    """The no-grad forwards for the reference's and the generating policy's log-probabilities (likewise)."""
    training: float
    """The training pass over the completions: speed_model's step at the completion rows' length."""

    @property
    def total(self) -> float:
        return self.generation + self.scoring + self.training

    def scaled(self, factor: float) -> RLStepSeconds:
        return RLStepSeconds(self.generation * factor, self.scoring * factor, self.training * factor)


@dataclass(frozen=True)
class RolloutShape:
    """What a rank's rollout of one step generates."""

    completions: int
    """Completions of the rank's step (micro-batch x accumulation)."""
    at_once: int
    """Completions generated together (--generation-batch-size, at most the step's)."""
    prompt_tokens: int
    """Tokens of a prompt (--max-prompt-length, else the estimate's --seq-len)."""
    completion_tokens: int
    """Decoding steps of a round: --max-completion-length."""
    iterations: int
    """--num-iterations: steps that train on one rollout."""

    @property
    def rounds(self) -> int:
        return math.ceil(self.completions / self.at_once)

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def rollout_shape(changes: dict[str, Any], config: Any) -> RolloutShape:
    """The rollout `changes` make of `config` (the planner's micro-batch, accumulation, generation batch, length)."""
    rl = config.rl
    completions = (max(1, int(changes.get("batch_size", config.training.batch_size)))
                   * max(1, int(changes.get("gradient_accumulation_steps", 1))))
    at_once = int(changes.get("generation_batch_size") or rl.generation_batch_size or completions)
    prompt = int(rl.max_prompt_length or config.data.seq_len_or_default)
    length = int(changes.get("max_completion_length") or rl.max_completion_length)
    return RolloutShape(completions, max(1, min(at_once, completions)), prompt, length, max(1, rl.num_iterations))


def rl_training_changes(changes: dict[str, Any], config: Any) -> dict[str, Any]:
    """`changes` as the training pass runs them: rows of prompt + completion tokens, the loss chunked."""
    shape = rollout_shape(changes, config)
    return {**changes, "seq_len": shape.row_tokens, "loss_chunk_size": changes.get("loss_chunk_size") or 1}


def rollout_seconds(changes: dict[str, Any], config: Any, hf_config: Any, gpu: Any, device: str, compute: str,
                    rate: float, feeding: int) -> tuple[float, float]:
    """(generation, scoring) seconds of one step, a rollout's over --num-iterations (module docstring); `feeding`:
    the tokens a forward needs to run at half its full rate (speed_model.FEEDING_TOKENS)."""
    from memfit.models.flops import flops_per_token

    shape = rollout_shape(changes, config)
    forward = flops_per_token(hf_config, shape.row_tokens).forward  # a token's forward at the row's mean context
    prefill_tokens = shape.at_once * shape.prompt_tokens
    prefill = shape.rounds * prefill_tokens * forward / (rate * prefill_tokens / (prefill_tokens + feeding))
    decode = shape.rounds * shape.completion_tokens * decode_step_seconds(
        changes, config, hf_config, gpu, device, compute, rate,
        shape.at_once / (shape.at_once + DECODE_FEEDING_TOKENS.get(device, feeding)), shape)
    passes = int(config.task.beta > 0) + int(shape.iterations > 1)
    rows = shape.completions * shape.row_tokens
    scoring = passes * rows * forward / (rate * rows / (rows + feeding))
    return (prefill + decode) / shape.iterations, scoring / shape.iterations


def decode_step_seconds(changes: dict[str, Any], config: Any, hf_config: Any, gpu: Any, device: str, compute: str,
                        rate: float, fed: float, shape: RolloutShape) -> float:
    """One decoding forward of `shape.at_once` completions: FLOPs at `fed` (the share of the rate a forward of
    that many tokens reaches) x `rate`, or on a GPU the weights and the cache read at the memory bandwidth where slower; on a CPU plus its
    operators' dispatch."""
    from memfit.models.flops import flops_per_token
    from memfit.prediction.activations import architecture_of

    arch = architecture_of(hf_config)
    seconds = shape.at_once * flops_per_token(hf_config, shape.row_tokens).forward / (rate * fed)
    if device == "cpu":
        return seconds + (arch.layers + DECODE_HEAD_CPU_BLOCKS) * DECODE_DISPATCH_CPU_FLOPS / rate
    bandwidth = getattr(gpu, "memory_gbps", 0.0) * 1e9
    if not bandwidth:
        return seconds
    weight_bytes = _parameters(hf_config) * _weight_bytes(changes, config, compute)
    cached = shape.prompt_tokens + shape.completion_tokens / 2  # the cache's mean length over the decoding steps
    kv_bytes = shape.at_once * cached * arch.layers * 2 * arch.kv_heads * arch.head_dim * (2 if compute == "bf16"
                                                                                           else 4)
    return max(seconds, (weight_bytes + kv_bytes) / bandwidth)


def _parameters(hf_config: Any) -> float:
    from memfit.models.state_bytes import parameter_inventory

    return float(sum(math.prod(shape) for shape in parameter_inventory(hf_config).shapes))


def _weight_bytes(changes: dict[str, Any], config: Any, compute: str) -> float:
    """Bytes a weight the decoding forward reads: 4-bit NF4 about half a byte, else the compute dtype's."""
    if changes.get("quantize", config.lora.quantize) == "4bit":
        return 0.55
    return 2.0 if compute == "bf16" else 4.0

"""What a `--task grpo` step holds: generation's key-value cache beside the training pass over the completions.

A step has two phases, and its peak is the larger (memfit.tasks.grpo runs them one after the other):

- **Generation**: the weights and the optimizer state (both live across the whole run; gradients are released
  after each optimizer step), a frozen reference copy when --beta > 0 without LoRA, and for the completions generated
  at once (--generation-batch-size, default every completion of the step) the key-value cache of their prompt and
  completion tokens, completions x tokens x layers x 2 (K and V) x KV heads x head size x the compute dtype's bytes,
  plus one position's logits a completion (fp32, and its softmax).
- **Training**: memfit's causal-LM step over --batch-size completions of prompt + completion tokens, its
  log-probabilities a chunk of logits at a time (the estimator's chunked loss), plus the reference copy.

The length of a completion row is --max-prompt-length (the estimate's --seq-len when not given: prompts are data an
estimate does not read) + --max-completion-length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GENERATION_LOGIT_COPIES = 3
"""One position's logits a completion as the sampler holds them: the model's output, its fp32 copy and its softmax."""


def is_rl(config: Any) -> bool:
    return config.task.task == "grpo"


def rl_training_config(config: Any) -> Any:
    """`config` as the training pass of its RL step runs: rows of prompt + completion tokens, the log-probabilities
    a chunk of logits at a time (the task's chunk: --loss-chunk-size, else the chunked loss's default)."""
    from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS

    return config.replace(seq_len=rl_row_length(config, config.data.seq_len),
                          loss_chunk_size=config.memory.loss_chunk_size or DEFAULT_LOSS_CHUNK_TOKENS)


def rl_row_length(config: Any, prompt_tokens: int) -> int:
    """Tokens of one completion's row: the prompt (--max-prompt-length, else `prompt_tokens`) and the completion."""
    rl = config.rl
    return int(rl.max_prompt_length or prompt_tokens) + int(rl.max_completion_length)


@dataclass(frozen=True)
class GenerationPhase:
    """The generation phase's bytes, by what holds them."""

    completions: int
    """Completions generated at once."""
    row_tokens: int
    kv_cache_bytes: int
    logits_bytes: int

    @property
    def working_bytes(self) -> int:
        return self.kv_cache_bytes + self.logits_bytes


def generation_phase(config: Any, arch: Any, compute_bytes: int, row_tokens: int, completions_in_step: int
                     ) -> GenerationPhase:
    """The cache and the logits of the completions generated at once (module docstring)."""
    at_once = min(int(config.rl.generation_batch_size or completions_in_step), completions_in_step)
    kv = at_once * row_tokens * arch.layers * 2 * arch.kv_heads * arch.head_dim * compute_bytes
    logits = at_once * arch.vocab * 4 * GENERATION_LOGIT_COPIES
    return GenerationPhase(at_once, row_tokens, int(kv), int(logits))


def with_generation_phase(moment: dict[str, float], parts: dict[str, Any], phase: GenerationPhase,
                          reference_bytes: float, notes: dict[str, Any]) -> dict[str, float]:
    """The step's peak moment: the training pass's (`moment`) or generation's, whichever holds more; both in `notes`.

    Generation holds the parameters, the optimizer state and the reference as the training moment counts them
    (already divided over ranks), no gradients, and its cache (counted as activations) and logits.
    """
    generation = {key: 0.0 for key in moment}
    generation["parameters"] = moment.get("parameters", 0.0)
    generation["optimizer_states"] = moment.get("optimizer_states", 0.0)
    generation["activations"] = float(phase.kv_cache_bytes)
    generation["logits"] = float(phase.logits_bytes)
    training_total, generation_total = sum(moment.values()), sum(generation.values())
    notes["rl_step"] = {
        "generation_bytes": int(generation_total), "training_bytes": int(training_total),
        "kv_cache_bytes": phase.kv_cache_bytes, "generation_logits_bytes": phase.logits_bytes,
        "completions_generated_at_once": phase.completions, "row_tokens": phase.row_tokens,
        "reference_copy_bytes": int(reference_bytes),
        "peak_phase": "generation" if generation_total > training_total else "training",
    }
    return generation if generation_total > training_total else moment

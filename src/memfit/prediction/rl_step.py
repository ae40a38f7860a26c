"""What a `--task grpo` step holds: generation's key-value cache beside the training pass over the completions.

A step has up to three phases, and its peak is the largest (memfit.tasks.grpo runs them one after the other):

- **Generation**: the weights and the optimizer state (both live across the whole run; gradients are released
  after each optimizer step), a frozen reference copy when --beta > 0 without LoRA, and for the completions generated
  at once (--generation-batch-size, default every completion of the step) the key-value cache of their prompt and
  completion tokens, completions x tokens x layers x 2 (K and V) x KV heads x head size x the compute dtype's bytes,
  plus one position's logits a completion and the sampler's buffers; or, where larger, the prompt's first forward
  (each distinct prompt once, a block's working set over its tokens, and one position's logits a prompt).
- **Scoring** (--beta > 0 or --num-iterations > 1): one no-grad forward over every completion of the step at once,
  its log-probabilities a chunk at a time, beside the weights, the optimizer state and the reference.
- **Training**: memfit's causal-LM step over --batch-size completions of prompt + completion tokens, its
  log-probabilities a chunk of logits at a time (the estimator's chunked loss), plus the reference copy.

The length of a completion row is --max-prompt-length (the estimate's --seq-len when not given: prompts are data an
estimate does not read) + --max-completion-length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GENERATION_DRAW_BYTES = 20
"""Bytes a vocabulary entry a completion the sampler holds while it draws (memfit.tasks.rollout's `_draw`): the fp32
softmax and two fp64 cumulative sums (tracked on CPU: exactly 20)."""


def is_rl(config: Any) -> bool:
    return config.task.task == "grpo"


def rl_training_config(config: Any, hf_config: Any = None) -> Any:
    """`config` as the training pass of its RL step runs: rows of prompt + completion tokens, the log-probabilities
    a chunk of logits at a time (the task's chunk: --loss-chunk-size, else sized by `hf_config`'s vocabulary and
    width as the task sizes it, techniques/sequence_logprobs.py `logprob_chunk_tokens`; the chunked loss's default
    without `hf_config`). --packing auto runs off here: every completion at its length saves no row, and auto pads
    a micro-batch whose packing saves none (tasks/grpo.py); samples packs, and the estimate adds its mask."""
    from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS
    from memfit.techniques.sequence_logprobs import config_logprob_chunk_tokens

    row = rl_row_length(config, config.data.seq_len)
    chosen = config.memory.loss_chunk_size
    chunk = (config_logprob_chunk_tokens(hf_config, config.training.batch_size * row, chosen) if hf_config is not None
             else chosen or DEFAULT_LOSS_CHUNK_TOKENS)
    packing = "samples" if config.data.packing == "samples" else "off"
    return config.replace(seq_len=row, loss_chunk_size=chunk, packing=packing)


def rl_row_length(config: Any, prompt_tokens: int) -> int:
    """Tokens of one completion's row: the prompt (--max-prompt-length, else `prompt_tokens`) and the completion."""
    rl = config.rl
    return int(rl.max_prompt_length or prompt_tokens) + int(rl.max_completion_length)


@dataclass(frozen=True)
class GenerationPhase:
    """The generation phase's bytes beside the weights and the optimizer state, by what holds them."""

    completions: int
    """Completions generated at once."""
    row_tokens: int
    """Tokens of a completion's row (prompt + completion)."""
    kv_cache_bytes: int
    """The cache at its largest: every token of a row but the last drawn (never fed back)."""
    logits_bytes: int
    """What a late decoding step holds beside the cache: the cache's growing copy of one layer, or one position's
    logits and the sampler's buffers, whichever is larger."""
    prompt_moment_bytes: int = 0
    """The prompt's first forward over the distinct prompts: their cache and a block's working set."""

    @property
    def working_bytes(self) -> int:
        return max(self.kv_cache_bytes + self.logits_bytes, self.prompt_moment_bytes)


def generation_phase(config: Any, arch: Any, precision: Any, row_tokens: int, completions_in_step: int
                     ) -> GenerationPhase:
    """The cache and the logits of the completions generated at once (module docstring).

    The prompt's first forward runs each distinct prompt once (a batch holds each --num-generations times, in a
    row) and makes one position's logits a prompt (memfit.tasks.rollout's `_prompt_forward`); its cache is then
    copied to every completion. The cache grows a token at a time by concatenation, so one layer's keys (or values)
    are held twice for a moment.
    """
    compute, residual = _bytes_of(precision)
    at_once = min(int(config.rl.generation_batch_size or completions_in_step), completions_in_step)
    prompt = max(1, row_tokens - int(config.rl.max_completion_length))
    per_token_layer = arch.layers * 2 * arch.kv_heads * arch.head_dim * compute
    cached = row_tokens - 1
    kv = at_once * cached * per_token_layer
    upcast = 4 if compute != 4 else 0  # the sampler's fp32 copy of one position's 16-bit logits
    draw = at_once * arch.vocab * (GENERATION_DRAW_BYTES + upcast)
    growing = at_once * cached * arch.kv_heads * arch.head_dim * compute
    late = max(growing, at_once * arch.vocab * compute + draw)
    tokens = distinct_prompts(at_once, int(config.rl.num_generations)) * prompt
    block = (3 * compute * arch.intermediate + 4 * residual * arch.hidden + 2 * compute * arch.head_dim) * tokens
    prompt_moment = tokens * per_token_layer + block
    return GenerationPhase(at_once, row_tokens, int(kv), int(late), int(prompt_moment))


def distinct_prompts(at_once: int, num_generations: int) -> int:
    """The most distinct prompts among `at_once` consecutive completions of --num-generations a prompt."""
    group = max(1, num_generations)
    return min(at_once, -(-at_once // group) + (1 if at_once % group else 0))


def _bytes_of(precision: Any) -> tuple[int, int]:
    """(compute, residual) bytes an element: a Precision, or one width for both."""
    if isinstance(precision, int):
        return precision, precision
    return int(precision.compute), int(precision.residual)


def scoring_bytes(config: Any, arch: Any, precision: Any, row_tokens: int, completions_in_step: int,
                  loss_chunk_tokens: int, streamed: Any = None, attention: str = "sdpa") -> float:
    """The no-grad forward over every completion of the step at once that scores them before training: the
    reference's log-probabilities (--beta > 0) and the generating policy's (--num-iterations > 1); 0 without.
    `streamed`: a host-copy reference's units (preference_step.StreamedUnits), on the device beside its forward.
    Packed (--packing samples), the forward also holds SDPA's block mask over its rows (`packed_rows_mask_bytes`)."""
    from memfit.prediction.preference_step import PreferenceStep, no_grad_forward_bytes

    if config.task.beta <= 0 and config.rl.num_iterations <= 1:
        return 0.0
    step = PreferenceStep("grpo", "copy", "", 1, 0, loss_chunk_tokens)
    return no_grad_forward_bytes(step, arch, precision, completions_in_step * row_tokens,
                                 streamed if config.task.beta > 0 else None) + packed_rows_mask_bytes(
        config, arch, precision, completions_in_step, row_tokens, attention, layers_holding=1)


def packed_rows_mask_bytes(config: Any, arch: Any, precision: Any, completions: int, row_tokens: int,
                           attention: str, layers_holding: int) -> int:
    """What packed completions add to a forward over `completions` of them under --packing samples: SDPA's
    block-diagonal mask and its per-layer copies (techniques/packed_attention.py `block_mask_bytes`; 0 for
    flash-attn and eager, and without packing).

    The rows themselves: packing puts the completions end to end in rows as wide as the longest, so a micro-batch
    holds its completions' summed length rounded up to whole rows. An estimate does not know the completions'
    lengths and counts each at --max-completion-length, where packing saves no row: the rows are the padded
    ones, and the mask is what packing adds. (The training pass's mask is counted for every causal-LM step that
    packs: estimator.py `packed_mask_estimate`; this is the scoring forward's, over all of a step's completions,
    one layer's copy at a time.) --packing auto pads a micro-batch whose packing saves no row: nothing added."""
    from memfit.techniques.packed_attention import block_mask_bytes

    if getattr(config.data, "packing", "off") != "samples":
        return 0
    element = int(getattr(precision, "attention", None) or _bytes_of(precision)[0])
    expanded = 2 * max(0, arch.q_width - arch.kv_width) * element
    return block_mask_bytes(completions, row_tokens, attention, layers_holding, element, expanded)


def reference_bytes(config: Any, run: Any, hf_config: Any, loaded_parameters: float) -> tuple[float, Any]:
    """(bytes of the reference's whole copy on the device, the units of a streamed one or None) under --beta > 0:
    a frozen copy of the weights as loaded; none under LoRA (adapters off); --reference host-copy streams its copy
    from host memory a unit at a time (prediction/preference_step.py `streamed_units`, prefetched on CUDA)."""
    from memfit.prediction.preference_step import streamed_units

    if config.task.beta <= 0:
        return 0.0, None
    if config.task.reference == "host-copy" and hf_config is not None:
        return 0.0, streamed_units(hf_config, loaded_parameters, run.weight_bytes, run.device_type == "cuda")
    return (0.0 if run.lora_r else float(loaded_parameters)), None


def with_generation_phase(moment: dict[str, float], parts: dict[str, Any], phase: GenerationPhase,
                          reference_bytes: float, notes: dict[str, Any], scoring: float = 0.0) -> dict[str, float]:
    """The step's peak moment: the training pass's (`moment`), generation's or the scoring forward's, whichever
    holds the most; each in `notes`.

    Generation and scoring hold the parameters (the reference's copy among them), and the optimizer state as the
    training moment counts them (already divided over ranks), no gradients; generation its cache (counted as
    activations) and logits, scoring its forward's working set.
    """
    generation = {key: 0.0 for key in moment}
    generation["parameters"] = moment.get("parameters", 0.0)
    generation["optimizer_states"] = moment.get("optimizer_states", 0.0)
    scored = dict(generation)
    scored["activations"] = float(scoring)
    if phase.prompt_moment_bytes > phase.kv_cache_bytes + phase.logits_bytes:
        generation["activations"] = float(phase.prompt_moment_bytes)
    else:
        generation["activations"] = float(phase.kv_cache_bytes)
        generation["logits"] = float(phase.logits_bytes)
    totals = {"training": sum(moment.values()), "generation": sum(generation.values()),
              "scoring": sum(scored.values()) if scoring else 0.0}
    peak = max(totals, key=totals.get)
    notes["rl_step"] = {
        "generation_bytes": int(totals["generation"]), "training_bytes": int(totals["training"]),
        "scoring_bytes": int(totals["scoring"]),
        "kv_cache_bytes": phase.kv_cache_bytes, "generation_logits_bytes": phase.logits_bytes,
        "prompt_forward_bytes": phase.prompt_moment_bytes,
        "completions_generated_at_once": phase.completions, "row_tokens": phase.row_tokens,
        "reference_copy_bytes": int(reference_bytes),
        "peak_phase": peak,
    }
    return {"training": moment, "generation": generation, "scoring": scored}[peak]

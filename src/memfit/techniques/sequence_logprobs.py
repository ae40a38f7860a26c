"""Log-probabilities of whole completions under a causal LM, a chunk of tokens at a time.

Preference objectives (DPO, SimPO, ORPO, KTO: tasks/preference_losses.py) score a completion
by the sum of its tokens' log-probabilities, log p(y | x) = sum_t log p(y_t | x, y_<t), for the
policy and for a frozen reference. Computed the plain way, each row of the batch builds
`[length, vocabulary]` logits, their fp32 copy and the fp32 log-softmax saved for backward
(and their gradients): with a 128k vocabulary, two 2k-token completions per pair and four pairs
that is 8 GiB per fp32 copy, more than the rest of a small model's step.

Saves: as the chunked loss (techniques/loss.py), the model runs with its head swapped for a probe
(`final_hidden_states`), and the head plus the log-softmax run `chunk_size` tokens at a time.
Only one chunk of logits is alive in forward, and again in backward, which recomputes each
chunk's logits. What stays is the final hidden states (a view) and one fp32 number per token.
A trained plain-Linear head runs all chunks in one autograd function that adds each chunk's
head gradient into one head-sized buffer in place (as techniques/chunked_head_loss.py does for
the loss); any other head (LoRA-wrapped, quantized, sharded, frozen) runs each chunk under
non-reentrant checkpointing. Under `torch.no_grad()` (a reference model) the chunks simply run.
A caller whose loss is a weighted sum of per-token functions of the log-probabilities (GRPO's) may say ahead what
gradient each token's value will get (`token_gradient`): a plain-Linear head's function (trained or frozen) then
takes each chunk's gradients while its logits are alive, and backward scales them instead of recomputing the
chunks (`_InPlaceHeadTokenLogprobs`).
Only the positions with a target reach the head (the prompt, padding and each row's last position are scored 0):
with a third of a row prompt, a third of the head's work is skipped. Costs: the output projection runs a second
time in backward, as for the chunked loss (not with a gradient said ahead); the scored positions' hidden states are
gathered into one tensor.
Numerics: the same per-token values as the materialized log-softmax and gather, up to float
summation order; log-probabilities and their sums are fp32 whatever the model's dtype.

Targets follow memfit's loss: `labels` has the shape of `input_ids`, position t predicts
labels[t + 1], and IGNORE_INDEX (-100) marks tokens that are not scored (the prompt, padding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.techniques.chunked_head_loss import (
    FROZEN_HEAD,
    autocast_state,
    backward_by_chunks,
    chunk_gradients,
    in_place_head_problem,
)
from memfit.techniques.head_gradients import head_gradients_in_place
from memfit.techniques.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    final_hidden_states,
    logit_postprocessing,
    unwrap_causal_lm,
)

Postprocess = Callable[[torch.Tensor], torch.Tensor]
TokenGradient = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(flat positions, their log-probabilities) -> the gradient the caller's loss will give those values`, up to one
factor common to all tokens (a loss scale, an average over micro-batches): see `sequence_logprobs`."""

log = logging.getLogger("memfit")

SMALLEST_CHUNK_TOKENS = 64
"""The fewest tokens `logprob_chunk_tokens` gives a chunk: below it the head's matrix product runs at a fraction of
its rate (the GRPO benchmark's 22.9M model on 2 CPU cores, 768 tokens a micro-batch: 0.28 steps/s with 32-token
chunks, 0.30 with 64, 0.295 with one 1,024-token chunk, whose peak is 200 MiB higher; 2026-11-28, load 1)."""


def logprob_chunk_tokens(vocab_size: int, hidden_size: int, tokens: int, chosen: int | None = None) -> int:
    """Tokens a chunk of the log-probabilities over `tokens` tokens: `chosen` (--loss-chunk-size) when given, else
    as many as make one chunk's `[chunk, vocabulary]` logits about the size of the `[tokens, hidden]` hidden states
    they are computed from (the tokens over vocabulary / hidden, rounded up to a power of two, between
    SMALLEST_CHUNK_TOKENS and DEFAULT_LOSS_CHUNK_TOKENS).

    Why not always DEFAULT_LOSS_CHUNK_TOKENS: a preference or RL micro-batch of a few hundred to a few thousand tokens
    is then one or two chunks, and its logits (with their fp32 log-softmax, and in backward their gradient) are the
    largest tensors of the step: at 768 tokens and a 32,000-token vocabulary, four copies of 94 MiB against 1 MiB of
    hidden states. Sized by the hidden states, the chunk's logits never dwarf the activations, and a large model
    (Llama-3.1-8B: 4,096 wide, 128K vocabulary) still gets chunks of hundreds of tokens, which keep a GPU's matrix
    units busy. The estimator sizes the chunk with the same rule (prediction/preference_step.py, rl_step.py).
    """
    if chosen:
        return int(chosen)
    per_hidden = -(-max(vocab_size, 1) // max(hidden_size, 1))
    chunk = 1 << max(0, (-(-max(tokens, 1) // per_hidden) - 1).bit_length())
    return int(min(DEFAULT_LOSS_CHUNK_TOKENS, max(SMALLEST_CHUNK_TOKENS, chunk)))


def config_logprob_chunk_tokens(hf_config, tokens: int, chosen: int | None = None) -> int:
    """`logprob_chunk_tokens` for a model of `hf_config` (its text part's vocabulary and width)."""
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    return logprob_chunk_tokens(int(text_config.vocab_size), int(text_config.hidden_size), tokens, chosen)


def model_logprob_chunk_tokens(model: torch.nn.Module, tokens: int, chosen: int | None = None) -> int:
    """`logprob_chunk_tokens` for `model`, read from its config."""
    return config_logprob_chunk_tokens(unwrap_causal_lm(model).config, tokens, chosen)


@dataclass
class SequenceLogprobs:
    """Each row's summed log-probability of its target tokens, with what it was summed over."""

    sums: torch.Tensor
    """`[rows]` fp32: sum over the row's targets of log p(labels[t + 1] | tokens up to t); carries gradients."""
    token_counts: torch.Tensor
    """`[rows]` fp32: how many targets each sum covers (the completion's length)."""
    per_token: torch.Tensor | None = None
    """`[rows, length]` fp32 when asked for: position t holds log p(labels[t + 1] | tokens up to t), 0 where
    labels[t + 1] is ignored and at the last position (it predicts nothing)."""
    entropy: torch.Tensor | None = None
    """`[rows, length]` fp32, no gradient, when asked for: the entropy of the distribution position t predicts
    from (at the given temperature), 0 where position t scores nothing (TRL's GRPO `entropy` metric)."""

    @property
    def means(self) -> torch.Tensor:
        """`[rows]` average log-probability per target token, what SimPO and ORPO compare (0 for a row without targets)."""
        return self.sums / self.token_counts.clamp(min=1)

    def restricted_to(self, labels: torch.Tensor) -> SequenceLogprobs:
        """The same per-token values summed over the targets of `labels` only (a subset of those scored).

        One forward over prompt + completion with every real token as a target serves both ORPO's
        NLL (all tokens) and its odds ratio (the completion's): restrict the first to the second.
        """
        if self.per_token is None:
            raise ValueError("restricted_to needs the per-token log-probabilities: pass per_token=True")
        kept = _shifted_targets(labels) != IGNORE_INDEX
        per_token = self.per_token * kept
        return SequenceLogprobs(per_token.sum(-1), kept.sum(-1, dtype=torch.float32), per_token)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_TOKENS,
    position_ids: torch.Tensor | None = None,
    per_token: bool = False,
    in_place_head: bool = True,
    temperature: float = 1.0,
    entropy: bool = False,
    token_gradient: TokenGradient | None = None,
) -> SequenceLogprobs:
    """Summed (and optionally per-token) log-probabilities of each row's target tokens (module docstring).

    `labels`: `[rows, length]`, IGNORE_INDEX where no token is scored; position t predicts labels[t + 1].
    `chunk_size`: tokens per head + log-softmax chunk; 0 runs the model's own forward and its whole
    `[rows, length, vocabulary]` logits (for a model whose forward changes the logits in ways
    techniques.loss.logit_postprocessing does not know).
    `position_ids`: packed rows' positions, as for the loss.
    `per_token`: also return the `[rows, length]` values (SequenceLogprobs.per_token).
    `in_place_head`: accumulate a trained plain-Linear head's gradient in place across chunks; False
    checkpoints each chunk instead (an engine that reduces gradients through hooks of its own).
    `temperature`: the logits are divided by it first (GRPO scores completions at their sampling temperature, as
    TRL's GRPOTrainer does).
    `entropy`: also return each scored position's entropy (SequenceLogprobs.entropy), computed from the chunks'
    logits as the forward makes them (no further pass over the head).
    `token_gradient`: the gradient the caller's loss gives each position's log-probability (positions index the
    flattened `[rows, length]`), known from the value alone, up to a factor common to every token. Where the
    plain-Linear head's function runs, each chunk's gradients are taken in forward and backward only scales them;
    a gradient that turns out not to be a multiple of the said one is recomputed chunk by chunk, as without it.
    """
    rows, length = labels.shape
    targets = _shifted_targets(labels).reshape(-1)
    scoring = _Scoring(temperature, entropy)
    with scoring.recording():
        if chunk_size > 0:
            token_logprobs = _chunked_token_logprobs(model, input_ids, targets, attention_mask, chunk_size,
                                                     position_ids, in_place_head, scoring, token_gradient)
        else:
            positions = {} if position_ids is None else {"position_ids": position_ids}
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **positions).logits
            # the model's forward has post-processed its logits already
            token_logprobs = token_target_logprobs(logits.reshape(-1, logits.size(-1)), targets,
                                                   scoring.after(_unchanged))
    token_logprobs = token_logprobs.view(rows, length)
    counts = (targets != IGNORE_INDEX).view(rows, length).sum(-1, dtype=torch.float32)
    entropies = (scoring.entropy_of(targets.numel()) * (targets != IGNORE_INDEX)).view(rows, length) if entropy else None
    return SequenceLogprobs(token_logprobs.sum(-1), counts, token_logprobs if per_token else None, entropies)


class _Scoring:
    """What the log-probabilities add to the model's own logit post-processing: the temperature, and (when asked)
    each chunk's entropy, recorded while the forward runs (a backward's recomputation of a chunk records nothing)."""

    def __init__(self, temperature: float, entropy: bool) -> None:
        self.temperature = float(temperature)
        self.chunks: list[torch.Tensor] | None = [] if entropy else None
        self.scored: torch.Tensor | None = None
        """The flat positions the chunks cover, in order (None: every position)."""
        self._recording = False

    @contextmanager
    def recording(self) -> Iterator[None]:
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def after(self, postprocess: Postprocess) -> Postprocess:
        def scored_logits(logits: torch.Tensor) -> torch.Tensor:
            logits = postprocess(logits)
            if self.temperature != 1.0:
                logits = logits / self.temperature
            return logits

        # a post-processing that only multiplies, and by what (head_gradients.py works such logits in place)
        factor = getattr(postprocess, "linear_factor", None)
        scored_logits.linear_factor = None if factor is None else factor / self.temperature
        if self.chunks is not None:  # token_target_logprobs hands over the log-softmax it computes anyway
            scored_logits.log_softmax_seen = self._seen
            scored_logits.entropy_seen = self._seen_entropy
        return scored_logits

    def _seen(self, log_probs: torch.Tensor) -> None:
        if self._recording:
            with torch.no_grad():
                self.chunks.append(_entropy(log_probs.detach()))

    def _seen_entropy(self, entropies: torch.Tensor) -> None:
        if self._recording:
            self.chunks.append(entropies.detach())

    def entropy_of(self, tokens: int) -> torch.Tensor:
        """`[tokens]` the recorded entropies at their positions, 0 elsewhere."""
        values = torch.cat(self.chunks).float()
        if self.scored is None:
            return values
        return torch.zeros(tokens, dtype=values.dtype, device=values.device).index_copy(0, self.scored, values)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """`[tokens]` entropy of the `[tokens, vocabulary]` log-softmax, one chunk-sized temporary."""
    return log_probs.exp().mul_(log_probs).sum(-1).neg_()


def token_target_logprobs(logits: torch.Tensor, targets: torch.Tensor, postprocess: Postprocess) -> torch.Tensor:
    """`[tokens]` fp32 log p(target) of `[tokens, vocabulary]` logits after `postprocess`, 0 where the target is ignored.

    The negated unreduced cross-entropy: it keeps only the fp32 log-softmax for backward, where a
    log_softmax followed by a gather would keep its input as well. A `postprocess` that records the entropy
    (`_Scoring.after`) gets that log-softmax: cross-entropy's own two steps (log-softmax, then the negative
    log-likelihood) run apart, the same values, so the entropy needs no second normalisation of the logits.
    """
    logits = postprocess(logits.float())
    seen = getattr(postprocess, "log_softmax_seen", None)
    if seen is None:
        return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    log_probs = torch.log_softmax(logits, dim=-1)
    seen(log_probs)
    return -F.nll_loss(log_probs, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    # Shift the labels, not the hidden states or logits (as the loss does): the last position predicts nothing.
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _unchanged(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _chunked_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                            attention_mask: torch.Tensor | None, chunk_size: int, position_ids: torch.Tensor | None,
                            in_place_head: bool, scoring: _Scoring, token_gradient: TokenGradient | None = None
                            ) -> torch.Tensor:
    """`[tokens]` log-probabilities of the flattened `targets`, one chunk of logits alive at a time."""
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings; use chunk_size=0")
    hidden, empty_logits = final_hidden_states(model, lm, head, input_ids, attention_mask, position_ids)
    hidden = hidden.reshape(-1, hidden.size(-1))
    anchor = empty_logits.float().sum()  # exactly 0; keeps the wrappers' backward hooks in the graph
    # Only the positions with a target go through the head: a prompt, padding and each row's last position are
    # scored 0 anyway, and the head's matrix product (three times: forward, recomputed, backward) is the largest
    # of a small model's step (a third of a GRPO row of 32 prompt and 64 completion tokens is prompt).
    if _shape_unknown(targets):  # a traced estimate's fake tensors: no data-dependent shape; every position runs
        return anchor + _head_logprobs(model, lm, head, hidden, targets, chunk_size, in_place_head, scoring)
    scored = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if scored.numel() in (0, targets.numel()):  # none scored: the head still runs, so every rank's graph has it
        every = torch.arange(targets.numel(), device=targets.device)
        return anchor + _head_logprobs(model, lm, head, hidden, targets, chunk_size, in_place_head, scoring,
                                       _at(token_gradient, every))
    scoring.scored = scored
    values = _head_logprobs(model, lm, head, hidden.index_select(0, scored), targets.index_select(0, scored),
                            chunk_size, in_place_head, scoring, _at(token_gradient, scored))
    return anchor + torch.zeros(targets.numel(), dtype=values.dtype, device=values.device).index_copy(0, scored, values)


def _shape_unknown(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (prediction/traced.py's step), whose values, and so a selection's size, are
    unknown."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _at(token_gradient: TokenGradient | None, positions: torch.Tensor) -> Callable | None:
    """`token_gradient` for the head's rows, which are the flat `positions`: `(start, end, values) -> gradient`."""
    if token_gradient is None:
        return None
    return lambda start, end, values: token_gradient(positions[start:end], values)


def _head_logprobs(model: torch.nn.Module, lm: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor,
                   targets: torch.Tensor, chunk_size: int, in_place_head: bool, scoring: _Scoring,
                   gradient_ahead: Callable | None = None) -> torch.Tensor:
    """`[tokens]` log-probabilities of `targets` from the `[tokens, hidden]` final hidden states, a chunk at a time.

    `gradient_ahead(start, end, values)`: the gradient rows start:end will get (`_at`), or None."""
    postprocess = scoring.after(logit_postprocessing(lm.config))
    if not torch.is_grad_enabled():  # a reference model: no graph, so nothing to recompute
        return torch.cat([token_target_logprobs(head(hidden_chunk), target_chunk, postprocess)
                          for hidden_chunk, target_chunk in zip(hidden.split(chunk_size), targets.split(chunk_size),
                                                                strict=True)])
    problem = in_place_head_problem(head, model)
    # a frozen plain Linear (LoRA leaves the head alone) has no gradient to sum, but one known ahead still saves the
    # chunks' recomputation
    if in_place_head and (not problem or (problem == FROZEN_HEAD and gradient_ahead is not None)):
        return _InPlaceHeadTokenLogprobs.apply(hidden, head.weight, head.bias, targets, chunk_size, postprocess,
                                               gradient_ahead)
    # Non-reentrant checkpointing keeps only each chunk's inputs; backward rebuilds its logits.
    chunks = [checkpoint(_chunk_logprobs, head, postprocess, hidden_chunk, target_chunk, use_reentrant=False)
              for hidden_chunk, target_chunk in zip(hidden.split(chunk_size), targets.split(chunk_size), strict=True)]
    return torch.cat(chunks)


def _chunk_logprobs(head: torch.nn.Module, postprocess: Postprocess, hidden_chunk: torch.Tensor,
                    target_chunk: torch.Tensor) -> torch.Tensor:
    return token_target_logprobs(head(hidden_chunk), target_chunk, postprocess)


class _InPlaceHeadTokenLogprobs(torch.autograd.Function):
    """Per-token log-probabilities of a plain Linear head's chunks; its weight's gradient is summed in one buffer.

    Checkpointed chunks would each make a head-sized weight gradient that autograd adds to the sum so
    far out of place (three head-sized tensors at once); here backward adds every chunk's into the
    first in place.

    With a gradient known ahead (`gradient_ahead`), forward takes each chunk's gradients right after its values,
    from the same logits, and keeps them (the hidden states' and the head's: tensors backward would make anyway);
    backward checks that the gradient it gets is that one times a common factor, and scales them. A chunk then
    costs three of the head's matrix products (the logits, the hidden states' gradient, the head's) instead of four
    (the logits made again in backward).
    A gradient of another shape is recomputed chunk by chunk, once said in the log.
    """

    warned = False

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, postprocess, gradient_ahead=None):
        token_logprobs = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.postprocess = chunk_size, postprocess
        ctx.autocast = autocast_state(hidden)
        ctx.ahead = None
        if gradient_ahead is not None:
            said = torch.empty_like(token_logprobs)

            def gradient(start, end, values):
                said[start:end] = gradient_ahead(start, end, values)
                return said[start:end]

            factor = getattr(postprocess, "linear_factor", None)
            if factor is not None and not ctx.autocast[2] and hidden.dtype == weight.dtype:
                grads = head_gradients_in_place(hidden, weight, bias, targets, chunk_size, factor,
                                                ctx.needs_input_grad[:3], gradient, token_logprobs,
                                                getattr(postprocess, "entropy_seen", None))
            else:
                grads = chunk_gradients(hidden, weight, bias, targets, chunk_size, ctx.autocast,
                                        ctx.needs_input_grad[:3], _value_of(postprocess), gradient, token_logprobs)
            ctx.ahead = (said, *grads)
            return token_logprobs
        for start in range(0, hidden.size(0), chunk_size):
            end = start + chunk_size
            # the projection itself, not a module call: module hooks would hang gradient hooks on inputs that
            # have no graph inside this forward
            token_logprobs[start:end] = token_target_logprobs(F.linear(hidden[start:end], weight, bias),
                                                              targets[start:end], postprocess)
        return token_logprobs

    @staticmethod
    def backward(ctx, grad_token_logprobs):
        ahead, ctx.ahead = ctx.ahead, None  # used once: a second backward recomputes
        factor = None if ahead is None else _common_factor(grad_token_logprobs, ahead[0])
        if factor is not None:
            return *(None if grad is None else grad.mul_(factor) for grad in ahead[1:]), None, None, None, None
        if ahead is not None and not _InPlaceHeadTokenLogprobs.warned:
            _InPlaceHeadTokenLogprobs.warned = True
            log.warning("memfit: the log-probabilities' gradient was not the one their caller said ahead: the head's"
                        " chunks are recomputed in backward (slower, the same gradients)")
        del ahead
        grads = backward_by_chunks(ctx, _value_of(ctx.postprocess), lambda start, end: grad_token_logprobs[start:end])
        return *grads, None, None, None, None


def _value_of(postprocess: Postprocess) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda logits, targets: token_target_logprobs(logits, targets, postprocess)


AHEAD_TOLERANCE = 1e-4
"""How far (relative, in norm) the gradient backward gets may be from a multiple of the one said ahead: float
rounding of the same loss computed another way, far below any error in it."""


def _common_factor(received: torch.Tensor, said: torch.Tensor) -> torch.Tensor | None:
    """The scalar c (a 0-d tensor) with received = c x said, within AHEAD_TOLERANCE, or None where there is none."""
    received, said = received.float(), said.float()
    said_norm = torch.linalg.vector_norm(said)
    received_norm = torch.linalg.vector_norm(received)
    factor = torch.dot(received, said) / said_norm.clamp(min=torch.finfo(torch.float32).tiny) ** 2
    off = torch.linalg.vector_norm(received - factor * said)
    both_zero = (said_norm == 0) & (received_norm == 0)
    if not bool(both_zero | (off <= AHEAD_TOLERANCE * received_norm)):
        return None
    return torch.where(both_zero, torch.zeros_like(factor), factor)

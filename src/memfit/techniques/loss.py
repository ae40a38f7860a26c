"""The training loss: summed token cross-entropy, normalized by the caller, optionally chunked.

The loop divides the summed loss of each micro-batch by the number of target tokens
of the whole effective batch, so that accumulation gives exactly the big-batch loss.

Chunked cross-entropy (`chunk_size > 0`, flag `--loss-chunk-size`)
    Saves: the `[batch, seq, vocab]` logits are never built, in forward or in backward.
    The plain loss holds the logits in the model dtype, their fp32 copy and the fp32
    log-softmax saved for backward (and as many bytes again for their gradients): with a
    128k vocabulary and 8k tokens that is 4 GiB per fp32 copy. Chunked, each chunk's
    head + loss runs under non-reentrant checkpointing, so only `chunk_size x vocab`
    logits are alive at any time; backward rebuilds them one chunk at a time. What stays
    is the final hidden states (one view, no copy). A trained plain-Linear head runs the
    same chunks in one autograd function instead, which adds each chunk's head gradient
    into one head-sized buffer in place (techniques/chunked_head_loss.py): checkpointed
    chunks would sum them out of place, three head-sized tensors at once.
    Costs: the output projection runs twice (once in forward, once again in backward
    for each chunk), about `2 x tokens x hidden x vocab` extra FLOPs, a few percent of
    a step for most models. Every position gets logits, padding and context included:
    shapes never depend on the labels, so the loss traces under fake tensors (the
    traced estimate) and needs no host synchronisation; ignored targets weigh zero.
    Supported heads: whatever `model.get_output_embeddings()` returns, called as a
    module (plain or tied `nn.Linear`, with bias, LoRA-wrapped or quantized), followed
    by the logit post-processing that Hugging Face models declare in their config:
    `logit_scale` (multiplied, Cohere), `logits_scaling` (divided, Granite) and
    `final_logit_softcapping` (tanh soft-capping, Gemma 2/3). A model whose forward
    changes the logits in any other way needs `--loss-chunk-size 0`.
    Wrappers: the model's own forward runs, with its head swapped for a probe that
    records the final hidden states and returns empty logits, so the hooks of every
    wrapper around it (FSDP2's parameter gathering, DeepSpeed's, PEFT's) run as usual;
    the empty logits join the loss (adding exactly 0) so that their backward hooks run too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.techniques.chunked_head_loss import chunked_head_loss_sum, in_place_head_problem

IGNORE_INDEX = -100

# Chunking pays off once the logits dwarf the hidden states; Llama 2 has 32000 tokens.
CHUNKING_MIN_VOCAB = 32000
DEFAULT_LOSS_CHUNK_TOKENS = 1024


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels are shifted by one inside the loss."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def default_loss_chunk_size(vocab_size: int, seq_len: int, batch: int) -> int:
    """Tokens per loss chunk when the user did not choose (0: no chunking).

    On for vocabularies of 32000 tokens or more, in chunks of 1024 tokens, when a
    micro-batch has more tokens than one chunk: there the logits are the largest
    activation of the step. Off for small vocabularies, where chunking would only
    cost the recomputed projection.
    """
    tokens = batch * max(seq_len - 1, 1)
    if vocab_size < CHUNKING_MIN_VOCAB or tokens <= DEFAULT_LOSS_CHUNK_TOKENS:
        return 0
    return DEFAULT_LOSS_CHUNK_TOKENS


def causal_lm_loss_sum(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 0,
    token_loss: Callable[..., torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    in_place_head: bool = True,
) -> torch.Tensor:
    """Sum of next-token cross-entropy over the target tokens of a micro-batch (fp32).

    `labels` has the shape of `input_ids`, with IGNORE_INDEX where no loss is taken
    (padding, overlap context); position t predicts labels[t + 1].
    With `chunk_size > 0` the output projection and the loss run `chunk_size` tokens
    at a time and are recomputed in backward (see the module docstring); the loss and
    the gradients equal the plain computation up to float summation order.
    `token_loss`: what turns logits into the summed loss (default `token_loss_sum`;
    --compile passes a compiled one).
    `position_ids`: packed rows' positions, restarting at each sample (memfit.data.packing).
    `in_place_head`: see `chunked_causal_lm_loss_sum`.
    """
    token_loss = token_loss or token_loss_sum
    if chunk_size > 0:
        return chunked_causal_lm_loss_sum(model, input_ids, labels, attention_mask, chunk_size, token_loss,
                                          position_ids=position_ids, in_place_head=in_place_head)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **_positions(position_ids))
    logits = outputs.logits
    # Shift the labels, not the logits: slicing off the last position would copy all of
    # [batch, seq, vocab] (and its gradient); the padded last target is ignored instead.
    targets = next_token_targets(labels, input_ids.size(1))
    return token_loss(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), _no_postprocessing)


def next_token_targets(labels: torch.Tensor, length: int) -> torch.Tensor:
    """Each position's target, [batch, length]: labels[t + 1] for position t.

    Labels one position longer than the input are a context-parallel shard's
    (memfit.distributed.sequence_shards): they already hold the target of the shard's last
    position, the first token of the next shard. Otherwise the last position has none.
    """
    if labels.size(1) == length + 1:
        return labels[:, 1:]
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, postprocess: Callable) -> torch.Tensor:
    """Summed cross-entropy of `[tokens, vocabulary]` logits, upcast to fp32 and post-processed, against `targets`.

    The element-wise tail of the step (the cast, softcapping, the log-softmax over the
    vocabulary): memory-bound work that --compile fuses into a few kernels.
    """
    return F.cross_entropy(postprocess(logits.float()), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _no_postprocessing(logits: torch.Tensor) -> torch.Tensor:
    return logits


def chunked_causal_lm_loss_sum(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    chunk_size: int,
    token_loss: Callable[..., torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    in_place_head: bool = True,
) -> torch.Tensor:
    """`causal_lm_loss_sum` without the full logits: see the module docstring.

    `in_place_head`: where the head trains and is a plain Linear, accumulate its gradient in
    place across chunks (techniques/chunked_head_loss.py); False keeps the checkpointed chunks
    (the engine reduces gradients through hooks of its own).
    """
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings; use --loss-chunk-size 0")
    hidden, empty_logits = final_hidden_states(model, lm, head, input_ids, attention_mask, position_ids)
    # Shift the labels, not the hidden states (as the plain loss does): the flattened
    # hidden states stay a view, and the last position of each row is simply ignored.
    hidden = hidden.reshape(-1, hidden.size(-1))
    targets = next_token_targets(labels, input_ids.size(1)).reshape(-1)

    postprocess = logit_postprocessing(lm.config)
    total = empty_logits.float().sum()  # exactly 0; keeps the wrappers' backward hooks in the graph
    if in_place_head and not in_place_head_problem(head, model):
        # one head-sized gradient, added to in place across chunks (techniques/chunked_head_loss.py)
        return total + chunked_head_loss_sum(hidden, targets, head, chunk_size, postprocess, token_loss or token_loss_sum)
    for hidden_chunk, target_chunk in zip(hidden.split(chunk_size), targets.split(chunk_size), strict=True):
        # Non-reentrant checkpoint keeps only the chunk's inputs; its logits are
        # rebuilt when backward reaches the chunk, so one chunk of logits is alive.
        total = total + checkpoint(_chunk_loss, head, postprocess, hidden_chunk, target_chunk,
                                   token_loss or token_loss_sum, use_reentrant=False)
    return total


def _chunk_loss(head, postprocess, hidden_chunk: torch.Tensor, target_chunk: torch.Tensor,
                token_loss: Callable[..., torch.Tensor]) -> torch.Tensor:
    return token_loss(head(hidden_chunk), target_chunk, postprocess)


class _HiddenStateProbe(torch.nn.Module):
    """Stands in for the output head during one forward: keeps its input, returns no logits."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden[..., :0].clone()  # empty, but its own tensor: wrappers may hook outputs that are not views


def final_hidden_states(
    model: torch.nn.Module,
    lm: torch.nn.Module,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states the head would receive, and the (empty) logits of the forward.

    Runs `model` itself, so wrappers' forward hooks run, with `head` swapped for a
    probe in its parent module for the duration of the call.
    """
    parent, name = _parent_of(lm, head)
    probe = _HiddenStateProbe()
    setattr(parent, name, probe)
    try:
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **_positions(position_ids))
    finally:
        setattr(parent, name, head)
    if probe.hidden is None:
        raise ValueError(
            f"{type(lm).__name__}'s forward does not call its output head as a module; use --loss-chunk-size 0"
        )
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return probe.hidden, logits


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    # Passed only when given: wrappers and models then see the same call as before packing existed.
    return {} if position_ids is None else {"position_ids": position_ids}


def _parent_of(root: torch.nn.Module, child: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for parent in root.modules():
        for name, module in parent.named_children():
            if module is child:
                return parent, name
    raise ValueError(f"the output head of {type(root).__name__} is not one of its modules; use --loss-chunk-size 0")


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside a PEFT (or compile) wrapper.

    PEFT's LoRA layers are injected into the base model in place, so calling the base
    model's parts runs the adapters too.
    """
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return getattr(model, "_orig_mod", model)


def logit_postprocessing(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's forward does to the head's output, from its config (fp32 logits in and out)."""
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    divide = getattr(config, "logits_scaling", None)  # Granite divides
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3

    def postprocess(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None and scale != 1:
            logits = logits * scale
        if divide is not None and divide != 1:
            logits = logits / divide
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    # a post-processing that only multiplies says by what (techniques/head_gradients.py runs it in place)
    postprocess.linear_factor = None if softcap else float(scale if scale is not None else 1) / float(divide or 1)
    return postprocess


def _resolve(facts, run) -> dict:
    chunk = facts.config.memory.loss_chunk_size
    if chunk is None:  # on where the logits are large; a label head has no vocabulary logits to chunk
        vocab = getattr(facts.hf_config, "vocab_size", 0) if facts.vocabulary_head else 0
        chunk = default_loss_chunk_size(vocab or 0, facts.config.data.seq_len_or_default,
                                        facts.config.training.batch_size)
    return {"loss_chunk_size": chunk}


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="loss_chunking", stage="step", settings=("loss_chunk_size",), after=("kernels",), resolve=_resolve,
        report=lambda run: {"loss_chunk_size": run.loss_chunk_size} if run.loss_chunk_size else {},
        summary="the output head and loss run a chunk of tokens at a time: no [batch, seq, vocab] logits; the head"
                " runs twice",
    )


TECHNIQUE = _technique()

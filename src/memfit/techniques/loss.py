"""The training loss: summed token cross-entropy, normalized by the caller, optionally chunked.

The loop divides the summed loss of each micro-batch by the number of target tokens
of the whole effective batch, so that accumulation gives exactly the big-batch loss.

Chunked cross-entropy (`chunk_size > 0`, flag `--loss-chunk-size`)
    Saves: the `[batch, seq, vocab]` logits are never built. The plain loss holds the
    logits in the model dtype, their fp32 copy and the fp32 log-softmax saved for
    backward (and as many bytes again for their gradients): with a 128k vocabulary
    and 8k tokens that is 4 GiB per fp32 copy. Chunked, only `chunk_size x vocab`
    logits are alive at any time, in forward and in backward; positions whose label
    is -100 get no logits at all.
    Costs: the output projection runs twice (once in forward, once again in backward
    for each chunk), about `2 x tokens x hidden x vocab` extra FLOPs, a few percent of
    a step for most models.
    Supported heads: whatever `model.get_output_embeddings()` returns, called as a
    module (plain or tied `nn.Linear`, with bias, LoRA-wrapped or quantized), followed
    by the logit post-processing that Hugging Face models declare in their config:
    `logit_scale` (multiplied, Cohere), `logits_scaling` (divided, Granite) and
    `final_logit_softcapping` (tanh soft-capping, Gemma 2/3). A model whose forward
    changes the logits in any other way needs `--loss-chunk-size 0`.
    Distributed: the backbone and the head are called directly, bypassing the forward
    of a DDP/FSDP wrapper; turn chunking off under `--sharding`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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
) -> torch.Tensor:
    """Sum of next-token cross-entropy over the target tokens of a micro-batch (fp32).

    `labels` has the shape of `input_ids`, with IGNORE_INDEX where no loss is taken
    (padding, overlap context); position t predicts labels[t + 1].
    With `chunk_size > 0` the output projection and the loss run `chunk_size` tokens
    at a time and are recomputed in backward (see the module docstring); the loss and
    the gradients equal the plain computation up to float summation order.
    """
    if chunk_size > 0:
        return chunked_causal_lm_loss_sum(model, input_ids, labels, attention_mask, chunk_size)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    logits = outputs.logits
    # Shift the labels, not the logits: slicing off the last position would copy all of
    # [batch, seq, vocab] (and its gradient); the padded last target is ignored instead.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def chunked_causal_lm_loss_sum(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    chunk_size: int,
) -> torch.Tensor:
    """`causal_lm_loss_sum` without the full logits: see the module docstring."""
    lm = unwrap_causal_lm(model)
    backbone = find_backbone(lm)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings; use --loss-chunk-size 0")
    outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]

    # Only positions with a target get logits: padding and context cost nothing.
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE_INDEX
    hidden = hidden[:, :-1, :].reshape(-1, hidden.size(-1))[keep]
    targets = targets[keep]
    if targets.numel() == 0:
        return hidden.sum().float() * 0.0  # keeps the graph so backward still runs

    postprocess = logit_postprocessing(lm.config)
    total = None
    for hidden_chunk, target_chunk in zip(hidden.split(chunk_size), targets.split(chunk_size), strict=True):
        # Non-reentrant checkpoint keeps only the chunk's inputs; its logits are
        # rebuilt when backward reaches the chunk, so one chunk of logits is alive.
        chunk_loss = checkpoint(_chunk_loss, head, postprocess, hidden_chunk, target_chunk, use_reentrant=False)
        total = chunk_loss if total is None else total + chunk_loss
    return total


def _chunk_loss(head, postprocess, hidden_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    logits = postprocess(head(hidden_chunk).float())
    return F.cross_entropy(logits, target_chunk, reduction="sum")


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside a PEFT (or compile) wrapper.

    PEFT's LoRA layers are injected into the base model in place, so calling the base
    model's parts runs the adapters too.
    """
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return getattr(model, "_orig_mod", model)


def find_backbone(lm: torch.nn.Module) -> torch.nn.Module:
    """The module of a causal LM that returns the last hidden states (before the head)."""
    if hasattr(lm, "get_decoder"):
        decoder = lm.get_decoder()
        if decoder is not None and decoder is not lm:
            return decoder
    for name in ("model", "transformer", "gpt_neox", "backbone"):
        module = getattr(lm, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    base = getattr(lm, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not lm:
        return base
    raise ValueError(f"cannot find the backbone of {type(lm).__name__}; use --loss-chunk-size 0")


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

    return postprocess

"""A frozen input embedding kept in host memory: the lookup runs there and only the looked-up rows go to the device.

Under LoRA/QLoRA the input embedding is frozen, and a large vocabulary makes it one of the biggest tensors a
run holds (gpt-oss-20b: 201,088 x 2,880 in bf16, 1.08 GiB) while a step reads only its tokens' rows. Here the
table moves to host memory (pinned where a GPU runs, so the rows copy without a staging buffer), the token ids
go to the host, `F.embedding` picks the rows there and the rows (batch x tokens x hidden) go to the device.

Saves: vocab x hidden x the weight's bytes on the device. Costs: the ids' copy to the host (a synchronisation)
and the rows' copy back each forward; backward never reaches the table (it is frozen), so nothing returns.

Where: an input embedding that is a plain `nn.Embedding`, frozen, and not shared with the output head (a tied
head projects with the same table on the device). An embedding that trains, is tied, or is a subclass with its
own forward (Gemma's scaled one) stays where it is, said in the one line `embedding_to_host` returns.
The module keeps its class, parameter name and forward hooks (PEFT's input-gradient hook under checkpointing
still runs on the rows), so checkpoints and adapters are unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from memfit.techniques.host_memory import mark_host


def why_not_on_host(model: nn.Module) -> str | None:
    """Why the input embedding of `model` cannot live in host memory, or None when it can."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        return "the model has no input embedding"
    if type(embedding) is not nn.Embedding:
        return f"the input embedding is a {type(embedding).__name__} with its own forward, not a plain nn.Embedding"
    if embedding.weight.requires_grad:
        return "the input embedding trains (a full fine-tune or a trained embedding): it stays on the device"
    if embedding_tied_to_head(model):
        return "the input embedding is tied to the output head, which projects with it on the device"
    return None


def embedding_tied_to_head(model: nn.Module) -> bool:
    """Whether the input embedding and the output head share one weight (then neither can move apart)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table, projection = getattr(embedding, "weight", None), getattr(head, "weight", None)
    return (table is not None and projection is not None
            and table.untyped_storage().data_ptr() == projection.untyped_storage().data_ptr())


def _host_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    device = input_ids.device
    rows = F.embedding(input_ids.to(self.weight.device), self.weight, self.padding_idx, self.max_norm,
                       self.norm_type, self.scale_grad_by_freq, self.sparse)
    if device.type == "cuda":
        rows = rows.pin_memory()  # a pinned source lets the copy run without a staging buffer
    return rows.to(device, non_blocking=device.type == "cuda")


def embedding_to_host(model: nn.Module) -> str:
    """Move the frozen input embedding of `model` to host memory (in place); one line saying what was done."""
    reason = why_not_on_host(model)
    if reason:
        return f"off: {reason}"
    embedding = model.get_input_embeddings()
    weight = embedding.weight
    device = weight.device
    host = weight.detach().to("cpu", copy=device.type != "cpu")
    if torch.cuda.is_available():
        host = host.pin_memory()
    # on a CPU-only machine the table does not move: marking it files its bytes as host memory in the accounting
    embedding.weight = nn.Parameter(mark_host(host), requires_grad=False)
    embedding.forward = types.MethodType(_host_forward, embedding)
    embedding.memfit_on_host = True
    size = host.numel() * host.element_size()
    return (f"input embedding {tuple(host.shape)} in host memory ({size / 2**30:.2f} GiB off the device); "
            "each step copies its looked-up rows to the device")


def embedding_on_host(model: nn.Module) -> bool:
    """Whether `embedding_to_host` moved this model's input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return bool(getattr(embedding, "memfit_on_host", False))


def _technique():
    from memfit.techniques.technique import Technique, apply_when_on, report_when_on

    return Technique(
        name="embedding_on_host", settings=("embedding_on_host",), after=("nf4_head",),
        resolve=lambda facts, run: {"embedding_on_host": facts.config.memory.embedding_on_host},
        apply=apply_when_on("embedding_on_host", "embedding on host", embedding_to_host),  # the frozen lookup
        report=report_when_on("embedding_on_host"),
        summary="the frozen input embedding stays in host memory; only the looked-up rows reach the device",
    )


TECHNIQUE = _technique()

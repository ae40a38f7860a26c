"""The steps of an untied head and embedding under --optimizer-in-backward: the largest tensors, stepped apart from
the blocks."""

from __future__ import annotations

import math
from typing import Any

from memfit.models.state_bytes import in_backward_step_temporary_bytes


def untied_edge_steps(run: Any, untied_edges: list[tuple[int, ...]], head_numel: int, trainable_bytes: int,
                      head_sums: float) -> tuple[float, float, float, float]:
    """Bytes at the two edge steps of an untied model in backward: (gradients, temporaries) at the head's step and
    (gradient, temporaries) at the embedding's.

    The head's gradient is complete (a chunked loss's sums added: `head_sums`) before any block's
    backward, so its step runs with every saved activation live and no block recomputed; the
    embedding's runs last, with the activations gone. Tracked on the Llama-3.1-8B shape at 1/1024
    (APOLLO-Mini, loss chunks of a quarter of the tokens): the peak is the head's moment.
    """
    if not untied_edges:
        return 0.0, 0.0, 0.0, 0.0

    def step(numel: int) -> float:
        return 0 if run.optimizer_offload else in_backward_step_temporary_bytes(run.optimizer, numel, trainable_bytes)

    if head_sums >= head_numel * trainable_bytes + step(head_numel):
        head = (float(head_sums), 0.0)
    else:
        head = (float(head_numel * trainable_bytes), float(step(head_numel)))
    last = max(math.prod(shape) for shape in untied_edges)
    return (*head, float(last * trainable_bytes), float(step(last)))

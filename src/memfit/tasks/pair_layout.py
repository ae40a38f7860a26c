"""How a preference pair becomes rows: two rows that each carry the prompt, or one row that computes it once.

two-rows: prompt + chosen and prompt + rejected, every pair's first row then every second (TRL's concatenated
layout; tasks/preference_samples.py `collate_preference`). The prompt runs through the model twice: with a 2k-token prompt
and 100-token answers, nine tenths of the step's activations are the same prompt computed twice.

shared-prompt (this module): one row a pair, `prompt + chosen + [prompt's last token] + rejected`, read as a trunk
and two branches:

- the trunk: the prompt but its last token; every token of the row sees it;
- the chosen branch: the prompt's last token, then the chosen answer;
- the rejected branch: a copy of the prompt's last token, then the rejected answer.

Position ids continue from the prompt in each branch (prompt 0..P-1, chosen P..P+C-1; the copy P-1, rejected
P..P+R-1), and a 4D attention mask lets a token see the trunk and the earlier tokens of its own branch, never the
other branch. So every token of a branch has exactly the context, position and therefore hidden state it has in its
own row of the two-row layout, and each answer's log-probabilities (and their gradients) are the two-row layout's.

Why the copy: the rejected answer's first token is predicted from the prompt's last hidden state, and in one causal
row that position already predicts the chosen answer's first token. The copy is the same token at the same position
seeing the same trunk, so its hidden state is the prompt's last hidden state again, and the next-token shift predicts
the rejected answer's first token from it: the unchanged chunked log-probabilities (techniques/sequence_logprobs.py)
score both answers, whatever the head (LoRA-wrapped, quantized, sharded). Costs: one token a pair computed twice;
the 4D mask, `rows x length x length` booleans (SDPA) or values of the model's dtype (eager), which the model keeps for
its forward and backward, and SDPA then runs its masked kernel (keys and values repeated to every query head, no
grouped-query fast path). Saves: the prompt's second pass, `P - 1` tokens of every layer's activations a pair.

Which kernels take the mask (transformers 5: `masking_utils` passes a 4D mask through unchanged): SDPA (a boolean
mask, True where a query may attend) and eager (an additive mask: 0 or the dtype's lowest value). Not flash-attn (no
4D masks), not FlexAttention (a tensor mask reaches it as a dense per-score bias, losing the block sparsity it runs
for), not models whose layers carry state from one position to the next (a mask cannot stop the chosen answer's
state flowing into the rejected one), not models that build their masks without transformers' masking utilities,
and not sliding-window or chunked attention shorter than the row (the custom mask replaces the window): those run
two rows, and `choose_pair_layout` says why.

split: the two-row layout's rows in two forwards, the chosen rows' and the rejected rows' (tasks/pair_split.py): at
the peak one side's activations instead of both, for one more forward of the rejected rows (run again in backward).
The same log-probabilities and gradients as two rows; for the paired objectives (KTO runs two rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import SequenceLogprobs

TWO_ROWS = "two-rows"
SHARED_PROMPT = "shared-prompt"
SPLIT = "split"

TRUNK = 0
"""Branch code of the prompt's tokens but its last: every token of the row sees them."""
CHOSEN_BRANCH = 1
"""Branch code of the prompt's last token and the chosen answer."""
REJECTED_BRANCH = 2
"""Branch code of the copy of the prompt's last token and the rejected answer."""
PADDING = -1
"""Branch code of padding: it sees only padding, so no query row is fully masked (SDPA would give NaN)."""

BOOLEAN_MASK = "boolean"
"""A mask of booleans, True where a query may attend: what SDPA takes."""
ADDITIVE_MASK = "additive"
"""A mask added to the attention scores, 0 where a query may attend, the dtype's lowest value elsewhere: eager's."""

_MASK_OF_KERNEL = {"sdpa": BOOLEAN_MASK, "eager": ADDITIVE_MASK}
_KERNEL_REFUSAL = {
    "flash": "flash-attn takes no 4D attention mask",
    "flex": "FlexAttention would take the 4D mask only as a dense per-score bias, losing the block sparsity it runs for",
}


# -- the choice -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairLayout:
    """The layout a run's pairs take, and why."""

    layout: str
    """TWO_ROWS, SHARED_PROMPT or SPLIT."""
    requested: str
    """What --pair-layout asked: auto, two-rows, shared-prompt or split."""
    reason: str
    mask: str = ""
    """The kind of 4D mask the attention kernel takes (BOOLEAN_MASK, ADDITIVE_MASK); '' for two rows."""

    @property
    def shared(self) -> bool:
        return self.layout == SHARED_PROMPT

    @property
    def split(self) -> bool:
        """The chosen rows and the rejected rows run as two forwards (tasks/pair_split.py)."""
        return self.layout == SPLIT

    @property
    def fell_back(self) -> bool:
        """shared-prompt or split was asked for and two rows run."""
        return self.requested in (SHARED_PROMPT, SPLIT) and self.layout != self.requested

    def facts(self) -> dict[str, str]:
        return {"layout": self.layout, "requested": self.requested, "reason": self.reason}

    def describe(self) -> str:
        return f"pair layout {self.layout} ({self.reason})"


NOT_YET_KNOWN = "the model and the training data are not known yet"
"""Why two rows run before a layout is chosen (a probe's or a test's batches)."""


def mask_refusal(model: torch.nn.Module, max_row_length: int) -> tuple[str, str]:
    """(the mask kind, '') when `model` and its attention kernel take the shared-prompt 4D mask for rows of up to
    `max_row_length` tokens, else ('', why not)."""
    from memfit.techniques.attention import attention_that_ran
    from memfit.techniques.packed_attention import positions_not_read, stateful_layers

    kernel = attention_that_ran(model)
    if kernel not in _MASK_OF_KERNEL:
        return "", _KERNEL_REFUSAL.get(kernel, f"the {kernel} attention kernel is not known to take a 4D mask")
    why = stateful_layers(model) or _window_shorter_than(model, max_row_length) or positions_not_read(model)
    return ("", why) if why else (_MASK_OF_KERNEL[kernel], "")


def _window_shorter_than(model: torch.nn.Module, length: int) -> str:
    # transformers hands a custom 4D mask to sliding-window and chunked layers unchanged: their window is lost
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) is not False else None
    chunk = getattr(config, "attention_chunk_size", None)
    for name, size in (("sliding-window", window), ("chunked", chunk)):
        if isinstance(size, int) and 0 < size < length:
            return (f"its {name} attention ({size} tokens) is shorter than the longest shared row ({length} tokens),"
                    " and a custom mask would replace the window")
    return ""


def choose_pair_layout(requested: str, model: torch.nn.Module | None, paired: bool,
                       segment_lengths: np.ndarray | None) -> PairLayout:
    """The layout of a run's pairs (module docstring).

    `segment_lengths`: `[pairs, 3]` prompt, chosen and rejected token counts of the training data. auto runs
    shared-prompt where the model and its kernel take the mask and the prompts are, summed over the data, at least
    as long as the shorter answers (below that the mask and the copied token cost about what the prompt saves);
    an explicit shared-prompt runs wherever the mask is taken; anything else runs two rows.
    """
    if requested == TWO_ROWS:
        return PairLayout(TWO_ROWS, requested, "asked for")
    if not paired:
        return PairLayout(TWO_ROWS, requested, "kto scores one completion and, without a gradient, a mismatched one:"
                                               " there is no pair of answers to share a prompt or run apart")
    if requested == SPLIT:
        return PairLayout(SPLIT, requested, "asked for: the chosen rows' forward, then the rejected rows', each"
                                            " side's activations alone at the peak")
    if model is None or segment_lengths is None or not len(segment_lengths):
        return PairLayout(TWO_ROWS, requested, NOT_YET_KNOWN)
    lengths = np.asarray(segment_lengths, dtype=np.int64).reshape(-1, 3)
    prompts, shorter = lengths[:, 0], lengths[:, 1:].min(axis=1)
    longest = int((lengths.sum(axis=1) + (prompts > 0)).max())
    mask, why_not = mask_refusal(model, longest)
    if why_not:
        return PairLayout(TWO_ROWS, requested, why_not)
    averages = f"prompts average {prompts.mean():.0f} tokens, the shorter answers {shorter.mean():.0f}"
    if requested == SHARED_PROMPT:
        return PairLayout(SHARED_PROMPT, requested, f"asked for; {averages}", mask)
    if prompts.sum() < shorter.sum():
        return PairLayout(TWO_ROWS, requested, f"auto: {averages}, too short a prompt to be worth sharing")
    return PairLayout(SHARED_PROMPT, requested, f"auto: the kernel takes the mask; {averages}", mask)


# -- the rows ---------------------------------------------------------------------------------------------------------


BRANCHES = "pair_branches"
"""Batch key of the `[pairs, length]` int8 branch codes (TRUNK, CHOSEN_BRANCH, REJECTED_BRANCH, PADDING)."""
POSITIONS = "pair_position_ids"
"""Batch key of the `[pairs, length]` position ids. Not `position_ids`: that name marks packed rows, whose attention
mask the step drops and whose positions it hands to the model itself."""


def collate_shared_prompt(samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """One row a pair (module docstring), right-padded to the longest (input_ids the pad id, 0 without one; labels
    IGNORE_INDEX; branch PADDING): labels IGNORE_INDEX on the prompt and on the copy of its last token, the answers'
    tokens elsewhere; the branches and positions under BRANCHES and POSITIONS; attention_mask 1 on the real tokens
    (what counts tokens; the model gets the 4D mask built from the branches)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    rows = [_shared_row(sample["prompt_ids"], sample["chosen_ids"], sample["rejected_ids"]) for sample in samples]
    length = max(len(tokens) for tokens, _, _, _ in rows)
    pad = 0 if pad_token_id is None else int(pad_token_id)
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    branches = torch.full((len(rows), length), PADDING, dtype=torch.int8)
    positions = torch.zeros((len(rows), length), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (tokens, targets, branch, position) in enumerate(rows):
        end = len(tokens)
        input_ids[row, :end], labels[row, :end], branches[row, :end], positions[row, :end] = tokens, targets, branch, position
        attention_mask[row, :end] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, BRANCHES: branches,
            POSITIONS: positions}


def _shared_row(prompt: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, branches, positions) of one pair's row."""
    prompt_length = len(prompt)
    last = prompt[-1:]  # empty for an empty prompt: then no token predicts either answer's first, as in two rows
    ignored = lambda count: torch.full((count,), IGNORE_INDEX, dtype=torch.long)  # noqa: E731
    branch = lambda code, count: torch.full((count,), code, dtype=torch.int8)  # noqa: E731
    chosen_start = max(prompt_length - 1, 0)  # the chosen branch starts at the prompt's last token
    tokens = torch.cat([prompt, chosen, last, rejected])
    labels = torch.cat([ignored(prompt_length), chosen, ignored(len(last)), rejected])
    if not prompt_length and len(rejected):
        labels[len(chosen)] = IGNORE_INDEX  # the chosen answer's last token must not predict the rejected's first
    branches = torch.cat([branch(TRUNK, chosen_start), branch(CHOSEN_BRANCH, prompt_length - chosen_start + len(chosen)),
                          branch(REJECTED_BRANCH, len(last) + len(rejected))])
    positions = torch.cat([torch.arange(prompt_length + len(chosen)),
                           torch.arange(chosen_start, chosen_start + len(last) + len(rejected))])
    return tokens, labels, branches, positions


def shared_prompt_attention_mask(branches: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32
                                 ) -> torch.Tensor:
    """`[pairs, 1, length, length]` mask of the rows of `branches`: a query sees the earlier (and its own) tokens of
    the trunk and of its own branch. `kind`: BOOLEAN_MASK (True: may attend) or ADDITIVE_MASK (of `dtype`)."""
    length = branches.shape[-1]
    query, key = branches[:, :, None], branches[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=branches.device).tril()
    visible = causal & ((key == query) | ((key == TRUNK) & (query != PADDING)))
    visible = visible[:, None]
    if kind == BOOLEAN_MASK:
        return visible
    if kind != ADDITIVE_MASK:
        raise ValueError(f"unknown mask kind {kind!r}")
    return torch.zeros(visible.shape, dtype=dtype, device=branches.device).masked_fill(~visible,
                                                                                       torch.finfo(dtype).min)


def every_token_labels(input_ids: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """Labels that score every real token a row predicts: the prompt, both answers. Not the padding, and not a
    branch's first token after the other branch (the copy of the prompt's last token, or with an empty prompt the
    rejected answer's first), which the other branch's last token would otherwise be trained to predict."""
    after_other_branch = F.pad(branches[:, :-1], (1, 0), value=TRUNK) == CHOSEN_BRANCH
    ignored = (branches == PADDING) | ((branches == REJECTED_BRANCH) & after_other_branch)
    return input_ids.masked_fill(ignored, IGNORE_INDEX)


def side_labels(labels: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """`[2 x pairs, length]`: `labels` split into the two-row layout's row kinds, every pair's chosen side then every
    rejected side. A label counts for the chosen side where its token is in the trunk or the chosen branch (the
    chosen row of two rows holds the prompt), for the rejected side where it is in the rejected branch."""
    chosen = labels.masked_fill((branches != TRUNK) & (branches != CHOSEN_BRANCH), IGNORE_INDEX)
    rejected = labels.masked_fill(branches != REJECTED_BRANCH, IGNORE_INDEX)
    return torch.cat([chosen, rejected])


def as_two_rows(per_token: torch.Tensor, labels: torch.Tensor, branches: torch.Tensor) -> SequenceLogprobs:
    """The per-token log-probabilities of shared-prompt rows (`[pairs, length]`, position t: log p(labels[t + 1])) as
    the two-row layout has them: `[2 x pairs]` sums and counts, every chosen side then every rejected side, with
    `[2 x pairs, length]` per-token values (what `SequenceLogprobs.restricted_to` reads with `side_labels`)."""
    sides = side_labels(labels, branches)
    kept = F.pad(sides[:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX
    values = per_token.repeat(2, 1) * kept
    return SequenceLogprobs(values.sum(-1), kept.sum(-1, dtype=torch.float32), values)


def layout_inputs(inputs: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(branches, positions) taken out of a loss function's keyword inputs: (None, None) for two rows."""
    return inputs.pop(BRANCHES, None), inputs.pop(POSITIONS, None)

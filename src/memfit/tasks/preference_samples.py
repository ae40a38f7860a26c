"""A preference task's samples: a pair (or KTO's labelled completion) as the step's sample, and the rows it collates
into (memfit.tasks.preference explains the layout)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memfit.data.preferences import PreferenceDataset, PreferencePair
from memfit.techniques.loss import IGNORE_INDEX

# -- the samples ------------------------------------------------------------------------------------------------------


def kl_partners(count: int, batch_size: int) -> np.ndarray:
    """For each of `count` KTO items, the item whose completion makes its mismatched (KL) row: within each run of
    `batch_size` items in data order, the previous one, the first taking the run's last (TRL's rotation by one)."""
    partners = np.arange(count, dtype=np.int64)
    for start in range(0, count, max(1, batch_size)):
        end = min(start + max(1, batch_size), count)
        partners[start:end] = np.roll(np.arange(start, end, dtype=np.int64), 1)
    return partners


class PreferenceSamples(torch.utils.data.Dataset):
    """The kept preference items as the step's samples: one dict of tensors an item (module docstring).

    A pair: prompt_ids, chosen_ids, rejected_ids; a KTO item: prompt_ids, completion_ids, kl_completion_ids (the
    mismatched completion, cut to the length as TRL cuts it), desirable. Each has `index` (its place here: what tells
    a redone micro-batch's metrics apart), `reference_logps` ([chosen, rejected] or [completion, KL]) once the cached
    reference is set, and `input_ids`: the tokens of both its rows back to back, which the step counts (tokens seen,
    padding) and nothing reads as a sequence. The rest of the data's attributes (lengths, seq_len, description,
    data_facts, policy, ...) are the PreferenceDataset's.
    """

    packed_by_task = True
    """The run never packs these items into windows (techniques/packed_attention.py `pack_for_model`): --packing is
    the task's, over the sequences of each micro-batch (tasks/pair_packing.py)."""

    def __init__(self, items: PreferenceDataset, kl_partner: np.ndarray | None = None):
        self.items = items
        self.kl_partner = kl_partner
        self.reference: torch.Tensor | None = None
        """`[items, 2]` cached reference log-probabilities, or None (another reference, or none)."""
        self.packing_facts: Any = None
        """`() -> dict`: how the task packs its micro-batches (set by the task; the run's packing facts read it)."""

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index) + (len(self) if int(index) < 0 else 0)
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} is out of range for {len(self)} items")
        sample = self.tokens(index)
        if self.reference is not None:
            sample["reference_logps"] = self.reference[index]
        return sample

    def tokens(self, index: int) -> dict[str, torch.Tensor]:
        """Item `index` without any reference: its token tensors, `index` and `input_ids` (class docstring)."""
        item = self.items[index]
        prompt = torch.tensor(item.prompt_ids, dtype=torch.long)
        if isinstance(item, PreferencePair):
            chosen = torch.tensor(item.chosen_ids, dtype=torch.long)
            rejected = torch.tensor(item.rejected_ids, dtype=torch.long)
            return {"input_ids": torch.cat([prompt, chosen, prompt, rejected]), "prompt_ids": prompt,
                    "chosen_ids": chosen, "rejected_ids": rejected, "index": torch.tensor(index)}
        completion = torch.tensor(item.completion_ids, dtype=torch.long)
        mismatched = torch.tensor(self._kl_completion(index, len(item.prompt_ids)), dtype=torch.long)
        return {"input_ids": torch.cat([prompt, completion, prompt, mismatched]), "prompt_ids": prompt,
                "completion_ids": completion, "kl_completion_ids": mismatched,
                "desirable": torch.tensor(bool(item.label)), "index": torch.tensor(index)}

    def _kl_completion(self, index: int, prompt_length: int) -> list[int]:
        # the partner's whole completion, then cut with this prompt: TRL builds the KL row before it truncates
        partner = int(self.kl_partner[index]) if self.kl_partner is not None else index
        whole = self.items.whole(int(self.items.policy.kept[partner]))
        return whole.completion_ids[: max(1, self.items.seq_len - prompt_length)]

    def facts(self) -> dict[str, Any]:
        """The run's packing facts (techniques/packed_attention.py `packing_facts`): how the micro-batches ran."""
        return self.packing_facts() if self.packing_facts is not None else {"mode": "off"}

    def fingerprint(self) -> str:
        """A digest of every token (and label) of every item: the data part of a cached reference's key."""
        digest = hashlib.sha256(f"{len(self)}".encode())
        for index in range(len(self)):
            for name, tensor in self.tokens(index).items():
                if name not in ("input_ids", "index"):
                    digest.update(name.encode() + tensor.numpy().astype(np.int64).tobytes())
        return digest.hexdigest()

    def __getattr__(self, name: str) -> Any:
        if name == "items" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.items, name)


def collate_preference(samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Two rows a sample, every sample's first row then every sample's second (module docstring), right-padded to the
    longest row (input_ids the pad id, 0 without one; labels IGNORE_INDEX; attention_mask 0), labels IGNORE_INDEX on
    the prompt too; and the per-sample values: pair_index, reference_logps, desirable, nll_weights where present."""
    rows = two_row_sequences(samples)
    length = max(len(prompt) + len(completion) for prompt, completion in rows)
    pad = 0 if pad_token_id is None else int(pad_token_id)
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (prompt, completion) in enumerate(rows):
        end = len(prompt) + len(completion)
        input_ids[row, : len(prompt)] = prompt
        input_ids[row, len(prompt) : end] = completion
        labels[row, len(prompt) : end] = completion
        attention_mask[row, :end] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask} | per_sample_values(samples)


def two_row_sequences(samples: Sequence[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt, completion) of each row of the two-row layout: every sample's first row, then every second (a pair's
    chosen then rejected answer; a KTO item's completion then its mismatched one)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    paired = "chosen_ids" in samples[0]
    sides = ("chosen_ids", "rejected_ids") if paired else ("completion_ids", "kl_completion_ids")
    return [(sample["prompt_ids"], sample[side]) for side in sides for sample in samples]


def per_sample_values(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """What a batch carries once a sample, in either layout: pair_index, and reference_logps, desirable, nll_weights
    where every sample has them."""
    values = {"pair_index": torch.stack([sample["index"] for sample in samples])}
    for name, batch_name in (("reference_logps", "reference_logps"), ("desirable", "desirable"),
                             ("nll_weight", "nll_weights")):
        if all(name in sample for sample in samples):
            values[batch_name] = torch.stack([sample[name] for sample in samples])
    return values

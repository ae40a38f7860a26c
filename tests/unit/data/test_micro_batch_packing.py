"""Sequences of a micro-batch packed into rows: the same per-token log-probabilities and gradients as one a row."""

from __future__ import annotations

import torch
from tests.tiny_llama import tiny_llama

from memfit.data.micro_batch_packing import pack_padded_rows, pack_sequences
from memfit.data.windows import IGNORE_INDEX
from memfit.techniques.sequence_logprobs import sequence_logprobs


def _batch(lengths: list[int], prompt: int = 3, vocab: int = 256) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    labels = [torch.cat([torch.full((prompt,), IGNORE_INDEX), row[prompt:]]) for row in ids]
    return ids, labels


def test_placement_fills_rows_and_restarts_positions():
    ids, labels = _batch([9, 3, 6, 5, 4])
    packed = pack_sequences(ids, labels, pad_token_id=0)
    assert packed.input_ids.shape == (3, 9)  # 9 | 6 + 3 | 5 + 4
    assert packed.padding_tokens == 0
    for index, sequence in enumerate(ids):
        row, start, size = int(packed.row_of[index]), int(packed.start_of[index]), int(packed.length_of[index])
        assert torch.equal(packed.input_ids[row, start:start + size], sequence)
        assert torch.equal(packed.position_ids[row, start:start + size], torch.arange(size))
        assert int(packed.labels[row, start]) == IGNORE_INDEX
    unpacked = packed.unpack(packed.input_ids, fill=-1)
    for index, sequence in enumerate(ids):
        assert torch.equal(unpacked[index, :len(sequence)], sequence)
        assert bool((unpacked[index, len(sequence):] == -1).all())


def test_packed_logprobs_and_gradients_equal_one_sequence_a_row():
    torch.manual_seed(0)
    lengths = [12, 5, 7, 4, 9, 3]
    ids, labels = _batch(lengths)
    padded_ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    padded_labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    mask = (torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()

    def run(pack: bool):
        model = tiny_llama(seed=1)
        if pack:
            packed = pack_padded_rows(padded_ids, padded_labels, mask, pad_token_id=0)
            assert packed.input_ids.shape[0] < len(lengths)
            scored = sequence_logprobs(model, packed.input_ids, packed.labels, None, chunk_size=8,
                                       position_ids=packed.position_ids, per_token=True)
            per_token = packed.unpack(scored.per_token)
        else:
            per_token = sequence_logprobs(model, padded_ids, padded_labels, mask, chunk_size=8, per_token=True).per_token
        weights = torch.arange(1, per_token.numel() + 1, dtype=torch.float32).view_as(per_token)
        (per_token * weights).sum().backward()  # a different weight per token: a misplaced token changes the grads
        return per_token.detach(), [p.grad.clone() for p in model.parameters()]

    plain_values, plain_grads = run(pack=False)
    packed_values, packed_grads = run(pack=True)
    torch.testing.assert_close(packed_values, plain_values, rtol=1e-4, atol=1e-5)
    for packed_grad, plain_grad in zip(packed_grads, plain_grads, strict=True):
        torch.testing.assert_close(packed_grad, plain_grad, rtol=1e-3, atol=1e-5)

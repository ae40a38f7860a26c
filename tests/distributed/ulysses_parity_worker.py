"""2 ranks (gloo): memfit's Ulysses attention, DeepSpeed's UlyssesSPAttentionHF and plain SDPA on the whole rows.

    torchrun --nproc_per_node 2 ulysses_parity_worker.py OUT.json

Writes, on rank 0, the largest differences of the outputs and of the query gradients from the
whole-row reference (memfit's; DeepSpeed's where it ran, else the error it raised).
"""

from __future__ import annotations

import json
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F


def whole_rows(query, key, value):
    groups = query.size(1) // key.size(1)
    return F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          is_causal=True).transpose(1, 2)


def shard(tensor, rank, size, dim=2):
    return tensor.chunk(size, dim=dim)[rank].detach().clone().requires_grad_(tensor.requires_grad)


def compare(name, attend, inputs, reference, rank, size, found):
    local = [shard(t, rank, size) for t in inputs]
    positions = torch.arange(inputs[0].size(2)).expand(inputs[0].size(0), -1).chunk(size, dim=1)[rank]
    output = attend(local, positions).reshape(reference[0].size(0), -1, *reference[0].shape[2:])
    (output * reference[2].chunk(size, dim=1)[rank]).sum().backward()  # this rank's share of the whole rows' loss
    mine = reference[0].chunk(size, dim=1)[rank]
    found[name] = {"output": (output - mine).abs().max().item(),
                   "query_grad": (local[0].grad - reference[1].chunk(size, dim=2)[rank]).abs().max().item()}


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 16, 8
    inputs = [torch.randn(batch, h, length, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads)]
    reference_out = whole_rows(*inputs)
    weights = torch.randn(reference_out.shape)  # a loss whose gradient depends on where each output lands
    (reference_out * weights).sum().backward()
    reference = (reference_out.detach(), inputs[0].grad, weights)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=True)

    from memfit.distributed.ulysses import ulysses_attention, use_context_group

    use_context_group(group, size)
    found: dict = {}
    compare("memfit", lambda t, p: ulysses_attention(module, *t, None, position_ids=p)[0], inputs, reference,
            rank, size, found)
    # One key-value head for 2 ranks: repeated per query head before the exchange.
    single = [inputs[0].detach().clone().requires_grad_(True), inputs[1][:, :1].detach().clone(),
              inputs[2][:, :1].detach().clone()]
    single_out = whole_rows(*single)
    (single_out * reference[2]).sum().backward()
    compare("memfit-one-kv-head", lambda t, p: ulysses_attention(module, *t, None, position_ids=p)[0], single,
            (single_out.detach(), single[0].grad, reference[2]), rank, size, found)
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        theirs = UlyssesSPAttentionHF(sdpa_attention_forward, batch, heads, dim, kv_heads, 1, group,
                                      local_seq_length=length // size, global_seq_length=length)
        theirs.core_attn_implementation = "sdpa"
        compare("deepspeed", lambda t, p: theirs(module, *t, None, position_ids=p)[0], inputs, reference,
                rank, size, found)
    except Exception as error:  # recorded for the test's skip reason
        found["deepspeed_error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as out:
            json.dump(found, out)
    dist.barrier()


if __name__ == "__main__":
    main()

"""Generation for online RL: completions sampled with a key-value cache, each seeded by itself.

Every completion draws its tokens from its own generator, seeded from (--seed, step, prompt, generation), so the
completions do not depend on how they were batched: a generation batch that runs out of memory is halved and the
rollout goes on with the same completions (`sample_completions`). Prompts are left-padded, positions count only real
tokens, a finished completion stops at its EOS (kept, as TRL keeps it) and pads after it.

The cache holds, for each completion being generated, its prompt and the tokens so far, over every layer and KV head:
completions x (prompt + completion) tokens x layers x 2 (K and V) x KV heads x head size x the dtype's bytes (what
memfit estimate counts for an RL step). One position's logits a row are alive at a time.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("memfit")


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn (TRL's GRPOConfig names)."""

    max_completion_length: int
    """Tokens generated per completion at most."""
    temperature: float = 1.0
    """Logits are divided by this before sampling."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches this."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (kept in it)."""
    pad_token_id: int = 0
    """What pads prompts on the left and finished completions on the right (never attended to, never scored)."""


@dataclass
class Rollout:
    """The completions of one rollout, in the order of the seeds given."""

    completions: list[list[int]]
    """Each completion's token ids, up to and including its EOS."""
    truncated: list[bool]
    """Whether a completion reached max_completion_length without an EOS."""
    generation_batch: int
    """Completions generated at once in the end (halved from the requested size by each out-of-memory error)."""
    events: list[dict] = field(default_factory=list)
    """One record for each out-of-memory error generation recovered from (metrics' run_changed)."""


def completion_seed(seed: int, step: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion's generator: a digest of where it sits in the run, not of the batch it ran in."""
    digest = hashlib.sha256(f"memfit-rollout:{seed}:{step}:{prompt_index}:{generation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_completions(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], sampling: Sampling,
                       generation_batch: int) -> Rollout:
    """One completion for each (prompt, seed), `generation_batch` at a time, halved on out-of-memory (down to one)."""
    device = next(model.parameters()).device
    completions: list[list[int] | None] = [None] * len(prompts)
    truncated = [False] * len(prompts)
    size, start, events = max(1, generation_batch), 0, []
    was_training = model.training
    model.eval()
    try:
        while start < len(prompts):
            end = min(start + size, len(prompts))
            try:
                batch = _sample_batch(model, prompts[start:end], seeds[start:end], sampling, device)
            except torch.OutOfMemoryError as error:
                if size == 1:
                    raise
                old, size = size, (size + 1) // 2
                log.warning("memfit: out of memory while generating %d completions at once: %d at once now, the same"
                            " completions (each is seeded by itself)", old, size)
                events.append({"technique": "generation", "reason": f"out of memory generating {old} at once",
                               "generation_batch": size, "error": str(error).split("\n")[0][:200]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            for offset, (tokens, cut) in enumerate(batch):
                completions[start + offset], truncated[start + offset] = tokens, cut
            start = end
    finally:
        model.train(was_training)
    return Rollout([c or [] for c in completions], truncated, size, events)


def _sample_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], sampling: Sampling,
                  device: torch.device) -> list[tuple[list[int], bool]]:
    """Sample the completions of a few prompts together, each row from its own generator."""
    rows = len(prompts)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    eos = torch.tensor(sampling.eos_token_ids or [-1], device=device)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    keyword = _cache_keyword(model)
    with torch.no_grad():
        logits, cache, attention_mask, positions = _prompt_forward(model, prompts, sampling.pad_token_id, device,
                                                                  keyword)
        for drawn in range(1, sampling.max_completion_length + 1):
            chosen = _draw(logits.float(), generators, sampling).to(device)
            chosen = torch.where(finished, torch.full_like(chosen, sampling.pad_token_id), chosen)
            for row in torch.nonzero(~finished).flatten().tolist():
                tokens[row].append(int(chosen[row]))
            finished = finished | torch.isin(chosen, eos)
            if bool(finished.all()) or drawn == sampling.max_completion_length:
                break  # the last token drawn is never fed back
            attention_mask = torch.cat([attention_mask, torch.ones((rows, 1), dtype=attention_mask.dtype,
                                                                   device=device)], dim=1)
            positions = positions + 1
            output = model(input_ids=chosen[:, None], attention_mask=attention_mask, position_ids=positions,
                           use_cache=True, **{keyword: cache})
            cache = getattr(output, "cache", None) or output.past_key_values
            logits = output.logits[:, -1, :]
    return [(row_tokens, not bool(finished[row])) for row, row_tokens in enumerate(tokens)]


def _prompt_forward(model: torch.nn.Module, prompts: list[list[int]], pad_token_id: int, device: torch.device,
                    keyword: str) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor]:
    """The first forward: (each row's last-position logits, the cache, the attention mask, the last positions).

    Each distinct prompt runs once (a GRPO batch holds every prompt --num-generations times), its cache then copied
    to the rows that share it, and only the last position's logits are made (`logits_to_keep`, where the model
    takes it): the prompt forward is the rollout's largest, and what the other prompt positions' logits would cost
    ([rows, prompt, vocabulary]) is wasted on a sampler that reads one position. The cache is a transformers Cache
    whose `reorder_cache` (beam search's) copies rows; a model whose cache has none runs every row instead.
    """
    keep_last = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}

    def first_forward(rows: list[list[int]]) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = _left_padded(rows, pad_token_id, device)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                       **{keyword: None}, **keep_last)
        cache = getattr(output, "cache", None) or output.past_key_values
        return output.logits[:, -1, :], cache, attention_mask, positions[:, -1:]

    distinct = [list(prompt) for prompt in dict.fromkeys(tuple(prompt) for prompt in prompts)]
    if len(distinct) == len(prompts):
        return first_forward(prompts)
    logits, cache, attention_mask, positions = first_forward(distinct)
    if not hasattr(cache, "reorder_cache"):
        return first_forward(prompts)
    index_of = {tuple(prompt): index for index, prompt in enumerate(distinct)}
    rows = torch.tensor([index_of[tuple(prompt)] for prompt in prompts], device=device)
    cache.reorder_cache(rows)
    return logits.index_select(0, rows), cache, attention_mask[rows], positions[rows]


def _left_padded(prompts: list[list[int]], pad_token_id: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of `prompts` left-padded to the longest."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, longest - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward's name for the key-value cache: `cache` in transformers 5.x's models, `past_key_values` before."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def _takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether the model's own forward names `argument` (a PEFT model forwards **kwargs to its base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(base.forward).parameters


def _draw(logits: torch.Tensor, generators: list[torch.Generator], sampling: Sampling) -> torch.Tensor:
    """One token a row: temperature, then top-p, then an inverse-CDF draw with the row's own uniform number."""
    probabilities = torch.softmax(logits / sampling.temperature, dim=-1).cpu()
    if sampling.top_p < 1.0:
        ordered, order = probabilities.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ranked above each one
        ordered = torch.where(before < sampling.top_p, ordered, torch.zeros_like(ordered))
        probabilities = torch.zeros_like(probabilities).scatter(-1, order, ordered)
    uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    # a float64 copy, then its sum: cumsum(dtype=float64) gives the same sums but its mixed-dtype kernel took 4x as
    # long on a CPU (2 ms a token for 8 completions of a 32000-token vocabulary)
    cumulative = probabilities.double().cumsum(dim=-1)
    cumulative = cumulative / cumulative[:, -1:]
    drawn = torch.searchsorted(cumulative, uniforms[:, None]).flatten()
    return drawn.clamp(max=probabilities.shape[-1] - 1)

"""Online RL as a task: GRPO and its variants (DAPO, Dr. GRPO, BNPO) under TRL's names and semantics.

A training item is a prompt (memfit.data.prompts). A step's prompts come from the schedule (`items_per_step`:
the step's completions / --num-generations), and right before the step (`prepares_on_policy`: the loop asks for
them then, never during the step before) `prepare` runs the rollout: G completions a prompt, sampled by
memfit.tasks.rollout with each completion seeded by itself, scored by the reward functions (memfit.tasks.rewards),
turned into group advantages; then, with the weights that generated them, the completions' per-token
log-probabilities under the reference (--beta > 0) and under the generating policy (--num-iterations > 1). Each
completion becomes one sample of the step (prompt + completion, its advantage and those log-probabilities), so the
StepRunner micro-batches them by --batch-size, an out-of-memory error splits a micro-batch and keeps the update, and
accumulation over completions is exact: `count` is 1 a completion and the loss of a micro-batch is its share of the
step's loss (memfit.tasks.grpo_losses) times the step's completions, which the step divides back out.

The loss runs the policy's per-token log-probabilities a chunk of logits at a time
(techniques/sequence_logprobs.py: never `[completions, length, vocabulary]`). The reference is the model with its
LoRA adapters off under --lora-r (no second copy), else a frozen copy (techniques/reference_model.py), on the device
or, under --reference host-copy, in host memory and brought a unit at a time (techniques/streamed_reference.py).

With --num-iterations N the rollout of a step is trained on for N optimizer steps (TRL's mu): steps k*N to k*N+N-1
share the completions generated at step k*N, their old log-probabilities taken before the first of those updates.
The rollout is a function of (--seed, step, prompt, generation), so a run resumed at a step that starts a rollout
generates the same completions; one resumed inside a rollout of N > 1 generates it again from the resumed weights
(said in the log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from memfit.data.micro_batch_packing import PackedRows, pack_padded_rows
from memfit.distributed.reference_shards import shard_reference_copy
from memfit.tasks.grpo_losses import STAT_NAMES, gradient_ahead, group_advantages, grpo_loss, token_weights
from memfit.tasks.rewards import load_reward_functions, score_completions
from memfit.tasks.rollout import Sampling, completion_seed, sample_completions
from memfit.tasks.sample_loss_task import SampleLossTask
from memfit.techniques.loss import IGNORE_INDEX
from memfit.techniques.reference_model import COPY_MODES, ReferenceCost, choose_reference, reference_copy
from memfit.techniques.reference_model import _peft_model as peft_model_of
from memfit.techniques.sequence_logprobs import sequence_logprobs
from memfit.techniques.streamed_reference import HOST_COPY, host_copy_problem, note_step, reference_pass

log = logging.getLogger("memfit")

BUILTIN_PROMPTS = "builtin:prompts"
"""The data of `memfit train --task grpo` without --dataset: arithmetic questions with their answers."""
SAMPLES_KEPT = 4
"""Completions of each logged step written to completions.jsonl (with their prompts and rewards) for the report."""


class PromptSamples(torch.utils.data.Dataset):
    """The prompts as the schedule's items: one dict a prompt (its tokens and its place)."""

    packed_by_task = True
    """The run never packs these prompts (techniques/packed_attention.py `pack_for_model`): --packing is the task's,
    over the completions of a training micro-batch (`CompletionPacking`)."""

    def __init__(self, items: list, max_completion_length: int, dataset: str):
        self.items = items
        self.seq_len = max(len(item.prompt_ids) for item in items) + max_completion_length
        self.lengths = [len(item.prompt_ids) + max_completion_length for item in items]
        self.description = (f"{len(items)} prompts from {dataset} (up to {self.seq_len - max_completion_length}"
                            f" tokens) + completions of up to {max_completion_length} tokens")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.items[int(index)]
        return {"input_ids": torch.tensor(item.prompt_ids, dtype=torch.long), "index": int(index)}

    def data_facts(self) -> dict[str, Any]:
        return {"prompts": len(self.items), "seq_len": self.seq_len}

    def facts(self) -> dict[str, Any]:
        """The run's packing facts (techniques/packed_attention.py `packing_facts`): how the completions ran."""
        packing_facts = getattr(self, "packing_facts", None)
        return packing_facts() if packing_facts is not None else {"mode": "off"}


class GRPOTask(SampleLossTask):
    """GRPO (and DAPO, Dr. GRPO, BNPO by --loss-type) on the model's own completions, scored by reward functions."""

    name = "grpo"
    unit = "completions"
    eval_metrics = ()
    prepares_on_policy = True

    def __init__(self, config: Any = None):
        super().__init__(config)
        rl = config.rl
        spec = rl.reward_function
        if spec is None and config.data.dataset in (None, BUILTIN_PROMPTS):
            # the bundled prompts carry their answers: the built-in that checks them is the reward (said in the log)
            spec = "answer-match"
            log.info("memfit: --reward-function not given: answer-match scores %s (each completion's final answer"
                     " against the data's answer column)", BUILTIN_PROMPTS)
        self.functions = load_reward_functions(spec, rl.reward_weights, rl.max_completion_length)
        self.beta = float(config.task.beta)
        self.reference_choice = choose_reference(
            config.task.reference if config.task.reference != "cached" else "auto", False, config.lora.lora_r > 0,
            self.beta > 0)
        self.reference_cost = ReferenceCost(self.reference_choice.mode, self.reference_choice.reason)
        self._model: torch.nn.Module | None = None
        self._copy: torch.nn.Module | None = None
        self._tokenizer: Any = None
        self._prompts: PromptSamples | None = None
        self._rollout: tuple[int, list[dict]] | None = None
        self._step_counts: tuple[int, int] = (1, 1)
        """(completions, scored completion tokens) of the rollout being trained, counted when it is built."""
        self._metrics: dict[str, float] = {}
        self._stats: dict[str, float] = {}
        self.packing = CompletionPacking(_requested_packing(config.data.packing))
        self.output_dir = Path(config.output.output_dir) if getattr(config, "output", None) else None

    # -- refusals and the data ------------------------------------------------------------------------------------

    def refusals(self, config: Any) -> list[str]:
        found = []
        rl, t = config.rl, config.training
        per_step = t.batch_size * t.gradient_accumulation_steps
        if per_step % rl.num_generations:
            found.append(f"--batch-size x --gradient-accumulation-steps ({per_step}) counts completions and must be a"
                         f" multiple of --num-generations ({rl.num_generations}): a prompt's completions are compared"
                         " within one step")
        if config.data.packing == "wrapped":
            found.append("--packing wrapped would cut completions across rows; --task grpo packs whole completions:"
                         " use --packing samples, auto or off")
        if config.task.reference == "cached" or config.task.precompute_ref_log_probs:
            found.append("--reference cached computes log-probabilities of fixed data before training; --task grpo"
                         " scores completions generated during training: use --reference auto")
        if self.reference_choice.mode == HOST_COPY and host_copy_problem(config.distributed):
            found.append(host_copy_problem(config.distributed))
        if t.auto_batch_size:
            found.append("--auto-batch-size probes with causal-LM windows; give --task grpo a --batch-size")
        if config.evaluation.eval_dataset or config.evaluation.eval_fraction:
            found.append("--task grpo has no held-out evaluation; the reward curve is its measure: drop --eval-*")
        return found

    def items_per_step(self, effective_batch: int) -> int:
        """Prompts per optimizer step: the step's completions over --num-generations."""
        return max(1, effective_batch // self.config.rl.num_generations)

    def prepare_model(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self._model, self._tokenizer = model, tokenizer
        if self.reference_choice.mode in COPY_MODES:  # sharded like the policy under FSDP2 and ZeRO-3
            self._copy = shard_reference_copy(reference_copy(model, self.reference_cost), self.reference_cost,
                                              self.config)
        if self.beta > 0:
            log.info("memfit: %s", self.reference_cost.describe())
        self.packing = decide_completion_packing(self.packing.requested, model)
        (log.warning if self.packing.fallback else log.info)("memfit: packing: %s", self.packing.describe())
        rl = self.config.rl
        log.info("memfit: generation: transformers' forward with a key-value cache, each completion seeded by itself;"
                 " %s at once (halved on out of memory)", rl.generation_batch_size or "all of a step's completions")
        if self.config.rl.use_vllm:
            log.warning("memfit: --use-vllm: vLLM is not wired into memfit's rollout; transformers' forward with a"
                        " key-value cache generates instead")

    def load_data(self, data_config: Any, tokenizer: Any, *, role: str = "training", say: bool = True, **_: Any
                  ) -> PromptSamples:
        from memfit.data.prompts import load_prompts

        if data_config.dataset is None:
            data_config = dataclasses.replace(data_config, dataset=BUILTIN_PROMPTS)
        items = load_prompts(data_config, tokenizer, max_prompt_length=self.config.rl.max_prompt_length, say=say)
        self._prompts = PromptSamples(items, self.config.rl.max_completion_length, str(data_config.dataset))
        self._prompts.packing_facts = lambda: self.packing.facts()  # the run's facts: what packed the completions
        return self._prompts

    # -- the rollout -----------------------------------------------------------------------------------------------

    def prepare(self, samples: list[dict], indices: Sequence[int], step: int) -> list[dict]:
        """The completions the step trains on (module docstring): the rollout of its prompts, or the one it shares."""
        note_step(self._copy, step)  # host-copy: its streamed passes' time is reported a step
        mu = self.config.rl.num_iterations
        first = step - step % mu
        if self._rollout is not None and self._rollout[0] == first:
            return self._rollout[1]
        if first != step:
            log.warning("memfit: step %d trains on the rollout of step %d (--num-iterations %d), which this launch did"
                        " not generate: generated again from the current weights", step + 1, first + 1, mu)
        completions = self._generate([int(s["index"]) for s in samples], first)
        self._rollout = (first, completions)
        return completions

    def _generate(self, prompt_indices: list[int], step: int) -> list[dict]:
        rl, model = self.config.rl, self._model
        group = rl.num_generations
        items = [self._prompts.items[i] for i in prompt_indices]
        prompts = [item.prompt_ids for item in items for _ in range(group)]
        seeds = [completion_seed(self.config.training.seed, step, index, g) for index in prompt_indices
                 for g in range(group)]
        started = time.perf_counter()
        rollout = sample_completions(model, prompts, seeds, self._sampling(),
                                     rl.generation_batch_size or len(prompts))
        self._generation_seconds = time.perf_counter() - started  # this rank's; the speed model predicts it
        self._rollout_events = rollout.events
        texts = [self._tokenizer.decode(ids, skip_special_tokens=True) for ids in rollout.completions]
        conversational = not isinstance(items[0].prompt, str)
        shown = [[{"role": "assistant", "content": text}] if conversational else text for text in texts]
        columns = {name: [item.columns.get(name) for item in items] for name in items[0].columns}
        scores = score_completions(self.functions, [item.prompt for item in items for _ in range(group)], shown,
                                  rollout.completions, columns)
        # every rank's completions in one gather a step (ROLLOUT_COLUMNS), as TRL gathers them: the advantages and
        # the reward metrics (a rank's own share alone would give another batch standard deviation under
        # --scale-rewards batch, and rank 0's reward only), the lengths, and the completions and tokens the loss is
        # normalised by (one rank's own count would weigh its tokens against the other ranks' wrongly)
        everyone, start = _gathered_over_ranks(_rollout_table(scores, rollout, rl.mask_truncated_completions))
        advantages, reward_stats = group_advantages(everyone[:, 0].to(scores.total.dtype), group, rl.scale_rewards)
        advantages = advantages[start:start + len(scores.total)]
        self._step_counts = _step_counts(everyone, start, len(scores.total))
        samples = [self._sample(prompt, completion, cut, float(advantage))
                   for prompt, completion, cut, advantage in zip(prompts, rollout.completions, rollout.truncated,
                                                                 advantages.tolist(), strict=True)]
        self._attach_logprobs(samples)
        self._rollout_metrics(everyone, list(scores.per_function), reward_stats, rollout)
        self._keep_samples(step, items, group, texts, scores.total)
        return samples

    def _sampling(self) -> Sampling:
        tokenizer, rl = self._tokenizer, self.config.rl
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
            token_id = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
            if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None) and token_id >= 0:
                eos_ids += (token_id,)
        pad = getattr(tokenizer, "pad_token_id", None)
        return Sampling(rl.max_completion_length, rl.temperature, rl.top_p, tuple(dict.fromkeys(eos_ids)),
                        int(pad if pad is not None else (eos_ids[0] if eos_ids else 0)))

    def _sample(self, prompt: list[int], completion: list[int], truncated: bool, advantage: float) -> dict:
        ids = torch.tensor(prompt + completion, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[len(prompt):] = ids[len(prompt):]
        if truncated and self.config.rl.mask_truncated_completions:
            labels[:] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "advantage": torch.tensor(advantage, dtype=torch.float32),
                "truncated": truncated}

    def _attach_logprobs(self, samples: list[dict]) -> None:
        """Per-token log-probabilities the step reads but never trains: the reference's, the generating policy's."""
        needs_old = self.config.rl.num_iterations > 1
        if self.beta <= 0 and not needs_old:
            return
        batch = self.collate(samples, self._tokenizer.pad_token_id)  # packed rows when the training pass packs
        device = next(self._model.parameters()).device
        rows = {k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS or k in PLACEMENT_KEYS}
        chunk = self._chunk_size(0, self._model, rows["input_ids"].numel())
        with torch.no_grad():
            if needs_old:
                old = self._per_token(self._model, rows, chunk)[0]
                for row, sample in enumerate(samples):
                    sample["old_logps"] = old[row, : len(sample["input_ids"])].float().cpu()
            if self.beta > 0:
                reference = self._reference_per_token(rows, chunk)
                for row, sample in enumerate(samples):
                    sample["ref_logps"] = reference[row, : len(sample["input_ids"])].float().cpu()

    def _reference_per_token(self, rows: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
        if self.reference_choice.mode == "adapters-off":
            with _adapters_off(self._model):
                return self._per_token(self._model, rows, chunk)[0]
        with reference_pass(self._copy):  # a streamed copy: timed, its head put back after the pass
            return self._per_token(self._copy, rows, chunk)[0]

    def _per_token(self, model: torch.nn.Module, rows: dict[str, torch.Tensor], chunk: int, entropy: bool = False,
                   token_gradient: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(`[completions, longest]` per-token log-probabilities, the labels, the per-token entropies when asked)
        one completion a row, as the loss reads them: computed on the packed rows and laid back out when the batch
        is packed (`collate`). The logits are divided by the sampling temperature first, as TRL's GRPOTrainer does.
        `token_gradient`: the loss's gradient known ahead, over the rows' positions (`_gradient_ahead`)."""
        scoring = {"temperature": self.config.rl.temperature, "entropy": entropy, "per_token": True,
                   "token_gradient": token_gradient}
        packed = _packed(rows)
        if packed is None:
            scored = sequence_logprobs(model, rows["input_ids"], rows["labels"], rows.get("attention_mask"),
                                       chunk_size=chunk, **scoring)
            return scored.per_token, rows["labels"], scored.entropy
        # no attention mask: transformers restricts attention to each completion from the restarting positions
        scored = sequence_logprobs(model, packed.input_ids, packed.labels, None, chunk_size=chunk,
                                   position_ids=packed.position_ids, **scoring)
        # a completion's last position scores the next one's first label, which packing ignores: 0, as padding is
        return (packed.unpack(scored.per_token), packed.unpack(packed.labels, fill=IGNORE_INDEX),
                None if scored.entropy is None else packed.unpack(scored.entropy))

    def _gradient_ahead(self, rows: dict[str, torch.Tensor], mask: torch.Tensor, advantages: torch.Tensor,
                        old: torch.Tensor | None, ref: torch.Tensor | None) -> Any:
        """The gradient the loss gives each position's log-probability, known from its value (grpo_losses
        `gradient_ahead`), over the positions of the rows the log-probabilities are computed on (packed or not):
        the policy's head then takes its gradients in forward, without a second pass over its chunks. `mask`, `old`
        and `ref`: one completion a row, as the loss reads them (`_completion_mask`)."""
        packed = _packed(rows)
        completions, tokens = self._step_counts
        rl = self.config.rl
        weights = token_weights(mask, self.config.task.loss_type, max_completion_length=rl.max_completion_length,
                                completions_in_step=completions, tokens_in_step=tokens)
        per_token = [advantages.to(mask.device).float()[:, None].expand_as(mask), old, ref, weights]

        def laid_out(values: torch.Tensor | None) -> torch.Tensor | None:
            if values is None:
                return None
            return (values if packed is None else packed.repack(values)).reshape(-1)

        low, high = self._clip_range
        return gradient_ahead(*map(laid_out, per_token), beta=self.beta, epsilon_low=low, epsilon_high=high)

    @property
    def _clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high): the ratio is clipped to [1 - the first, 1 + the second]."""
        rl = self.config.rl
        return rl.epsilon, rl.epsilon if rl.epsilon_high is None else rl.epsilon_high

    # -- the batch and the loss ------------------------------------------------------------------------------------

    def collate(self, samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
        """Completions right-padded to the longest of the micro-batch, or packed into rows that wide when the
        training pass packs (`packed_rows`); their advantages and log-probabilities one completion a row."""
        batch = self.padded(samples, pad_token_id)
        if self.packing.mode != "samples":
            return batch
        packed = packed_rows(batch, pad_token_id)
        if self.packing.requested == "auto" and len(packed["input_ids"]) == len(batch["input_ids"]):
            return batch  # no row saved: padded rows keep SDPA's causal path, with no block mask to hold
        return packed

    def row_positions(self, samples: Sequence[dict]) -> int:
        """Positions the training pass runs for `samples` as `collate` lays them out: packed rows when it packs."""
        padded = super().row_positions(samples)
        if self.packing.mode != "samples":
            return padded
        from memfit.data.packing import best_fit_decreasing

        lengths = [int(s["input_ids"].numel()) for s in samples]
        rows = len(best_fit_decreasing(lengths, max(lengths)))
        keeps_padding = self.packing.requested == "auto" and rows == len(samples)  # auto pads: no row saved
        return padded if keeps_padding else rows * max(lengths)

    def padded(self, samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
        """Completions right-padded to the longest of the micro-batch; their advantages and log-probabilities."""
        length = max(len(s["input_ids"]) for s in samples)
        pad = 0 if pad_token_id is None else int(pad_token_id)
        rows = len(samples)
        batch = {"input_ids": torch.full((rows, length), pad, dtype=torch.long),
                 "labels": torch.full((rows, length), IGNORE_INDEX, dtype=torch.long),
                 "attention_mask": torch.zeros((rows, length), dtype=torch.long),
                 "advantages": torch.stack([s["advantage"] for s in samples])}
        for name, batch_name in (("old_logps", "old_per_token_logps"), ("ref_logps", "ref_per_token_logps")):
            if all(name in s for s in samples):
                batch[batch_name] = torch.zeros((rows, length), dtype=torch.float32)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            batch["input_ids"][row, :n] = sample["input_ids"]
            batch["labels"][row, :n] = sample["labels"]
            batch["attention_mask"][row, :n] = 1
            for name, batch_name in (("old_logps", "old_per_token_logps"), ("ref_logps", "ref_per_token_logps")):
                if batch_name in batch:
                    batch[batch_name][row, :n] = sample[name]
        return batch

    def loss_sum(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, chunk_size: int = 0, *, advantages: torch.Tensor,
                 old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, **placement: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the step's GRPO loss, times the step's completions (the step divides by them).
        `placement`: where each completion sits in packed rows (`packed_rows`), absent for padded ones."""
        completions, tokens = self._step_counts
        rows = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
                "position_ids": position_ids} | {k: v for k, v in placement.items() if k in PLACEMENT_KEYS}
        mask = _completion_mask(rows)
        old, ref = (None if logps is None else logps.to(mask.device)
                    for logps in (old_per_token_logps, ref_per_token_logps))
        ahead = self._gradient_ahead(rows, mask, advantages, old, ref)
        per_token, _, entropies = self._per_token(model, rows, self._chunk_size(chunk_size, model, input_ids.numel()),
                                                  entropy=True, token_gradient=ahead)
        low, high = self._clip_range
        loss, stats = grpo_loss(
            per_token, mask, advantages.to(per_token.device), old_per_token_logps=old, ref_per_token_logps=ref,
            loss_type=self.config.task.loss_type, beta=self.beta, epsilon_low=low, epsilon_high=high,
            max_completion_length=self.config.rl.max_completion_length, completions_in_step=completions,
            tokens_in_step=tokens, entropies=entropies)
        for name, value in stats.items():
            self._stats[name] = self._stats.get(name, 0.0) + float(value)
        return loss * completions

    def _chunk_size(self, chunk_size: int, model: torch.nn.Module, tokens: int) -> int:
        """--loss-chunk-size, else a chunk whose logits are about the size of the rows' hidden states."""
        from memfit.techniques.sequence_logprobs import model_logprob_chunk_tokens

        return chunk_size or model_logprob_chunk_tokens(model, tokens, self.config.memory.loss_chunk_size)

    # -- what the run says -----------------------------------------------------------------------------------------

    def _rollout_metrics(self, everyone: torch.Tensor, functions: list[str], reward_stats: dict, rollout: Any) -> None:
        # over every rank's completions under torchrun (the gathered ROLLOUT_COLUMNS), not one rank's share
        lengths, truncated = everyone[:, 1], everyone[:, 2]
        metrics = {"reward": float(reward_stats["reward"]), "reward_std": float(reward_stats["reward_std"]),
                   "frac_reward_zero_std": float(reward_stats.get("frac_reward_zero_std", 0.0)),
                   "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float(truncated.mean()) if truncated.numel() else 0.0,
                   "generation_batch": rollout.generation_batch,
                   "generation_seconds": self._generation_seconds,
                   # each out-of-memory error generation recovered from (halving its batch, the same completions)
                   "generation_oom_halvings": len(rollout.events)}
        for column, name in enumerate(functions, start=len(ROLLOUT_COLUMNS)):
            values = everyone[:, column]
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(values))
            metrics[f"rewards/{name}/std"] = float(_nanstd(values))
        self._metrics = metrics

    def step_metrics(self) -> dict[str, Any]:
        """The rollout's metrics and the loss's (kl, clip_ratio/*, per token of the step), under TRL's names."""
        metrics, self._metrics = self._metrics, {}
        stats, self._stats = self._stats, {}
        # the loss's metrics over every rank's tokens under torchrun, in one all-reduce of the sums (every rank calls
        # this once a step): rank 0's tokens alone would be another figure than one process's on the same completions
        names = ("tokens", *STAT_NAMES)
        sums = _summed_over_ranks(torch.tensor([float(stats.get(name, 0.0)) for name in names], dtype=torch.float64))
        tokens = float(sums[0])
        for name, value in zip(names[1:], sums[1:].tolist(), strict=True):
            if name in stats and (name != "kl" or self.beta > 0):
                metrics[name] = value / tokens if tokens else 0.0
        return metrics

    @classmethod
    def step_scores(cls, record: dict[str, Any]) -> list[str]:
        scores = []
        if "reward" in record:
            scores.append(f"reward {record['reward']:.3f} ± {record.get('reward_std', 0.0):.3f}")
        if "completions/mean_length" in record:
            scores.append(f"length {record['completions/mean_length']:.0f}")
        return scores

    def _keep_samples(self, step: int, items: list, group: int, texts: list[str], rewards: torch.Tensor) -> None:
        """A few completions of the step, with their prompts and rewards, in <output-dir>/completions.jsonl."""
        if self.output_dir is None or not _is_main_process():
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "completions.jsonl", "a", encoding="utf-8") as file:
            for number in range(min(SAMPLES_KEPT, len(texts))):
                prompt = items[number // group].prompt
                file.write(json.dumps({"step": step + 1, "prompt": prompt if isinstance(prompt, str) else prompt[-1]
                                       .get("content"), "completion": texts[number],
                                       "reward": None if math.isnan(float(rewards[number])) else float(rewards[number])})
                           + "\n")

    def facts(self) -> dict[str, Any]:
        rl = self.config.rl
        return super().facts() | {
            "name": self.name, "loss_type": self.config.task.loss_type, "beta": self.beta,
            "num_generations": rl.num_generations, "max_completion_length": rl.max_completion_length,
            "num_iterations": rl.num_iterations, "rewards": [f"{f.name} x{f.weight:g}" for f in self.functions],
            "generation": "transformers forward with a key-value cache, each completion seeded by itself"
                          + (" (--use-vllm asked: vLLM is not wired into memfit's rollout)" if rl.use_vllm else ""),
            "generation_batch": rl.generation_batch_size or "all of the step's completions",
            "reference": self.reference_cost.facts(), "packing": self.packing.describe()}

    def describe(self) -> str:
        return (f"grpo ({self.config.task.loss_type}; {self.config.rl.num_generations} completions a prompt; rewards "
                + ", ".join(f.name for f in self.functions) + f"; {self.reference_cost.describe()})")


MODEL_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids")
"""The rows a forward reads."""
PLACEMENT_KEYS = ("packed_row_of", "packed_start_of", "packed_length_of")
"""Where each completion of a packed micro-batch went (data/micro_batch_packing.py PackedRows): its row, its start
in that row, its length."""


@dataclasses.dataclass(frozen=True)
class CompletionPacking:
    """How the training pass lays out a micro-batch's completions (docs/rl.md, "Packed completions")."""

    requested: str
    """--packing as given: auto, samples or off."""
    mode: str = "off"
    """What runs: samples (packed rows, positions restarting at each completion) or off (padded to the longest)."""
    reason: str = ""
    """Why `mode` runs."""
    fallback: bool = False
    """--packing samples was asked and the model cannot pack: off runs instead."""

    def describe(self) -> str:
        return f"{self.mode}: {self.reason}" if self.reason else self.mode

    def facts(self) -> dict[str, Any]:
        return {"mode": self.mode, "requested": self.requested, "reason": self.reason, "fallback": self.fallback,
                "applies_to": "the training pass and the old-policy and reference forwards; generation pads"}


def _requested_packing(packing: Any) -> str:
    """--packing as GRPO reads it (a bool is the old flag: True auto, False off)."""
    if isinstance(packing, bool):
        return "auto" if packing else "off"
    return str(packing)


def decide_completion_packing(requested: str, model: torch.nn.Module) -> CompletionPacking:
    """What packs the training pass's completions. samples: every micro-batch packed, unless the model cannot
    restrict attention from positions (techniques/packed_attention.py): then off, said as a fallback. auto: a
    micro-batch is packed when its completions fit fewer rows than one a row, else padded (`GRPOTask.collate`):
    measured on CPU under SDPA (docs/rl.md, "Packed completions"), packing completions of mixed lengths cut the
    training pass's tracked peak to 0.44x in the same time, while completions of one length gain no row and hold
    SDPA's block mask; off for a model that cannot pack, said in the log (nothing asked for fell back). The kernel
    that runs only changes what packing costs (flash-attn and FlexAttention build no mask), not the rule."""
    from memfit.techniques.packed_attention import attention_restriction, positions_not_read, stateful_layers

    if requested not in ("auto", "samples"):
        return CompletionPacking(requested, "off", "one completion a row, padded to the longest of its micro-batch")
    why = stateful_layers(model) or positions_not_read(model)
    if why:
        return CompletionPacking(requested, "off", f"--packing {requested} cannot pack ({why}): one completion a row,"
                                 " padded", fallback=requested == "samples")
    kernel = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    named = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flex_attention": "flex"}.get(kernel, kernel)
    when = " when that saves rows" if requested == "auto" else ""
    return CompletionPacking(requested, "samples", "completions packed into rows as wide as the longest of their"
                             f" micro-batch{when}, attention kept to each by {attention_restriction(named)}")


def packed_rows(batch: dict[str, torch.Tensor], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """A padded GRPO batch (`GRPOTask.padded`) with its rows packed (data/micro_batch_packing.py): the model reads
    the packed input_ids, labels and position_ids (no attention mask); the advantages and the stored
    log-probabilities stay one completion a row, and PLACEMENT_KEYS say where each completion went."""
    packed = pack_padded_rows(batch["input_ids"], batch["labels"], batch["attention_mask"], pad_token_id)
    rest = {k: v for k, v in batch.items() if k not in MODEL_INPUTS}
    return rest | {"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids,
                   "packed_row_of": packed.row_of, "packed_start_of": packed.start_of,
                   "packed_length_of": packed.length_of}


def _completion_mask(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[completions, longest]` 1 at the positions the loss scores, one completion a row (unpacked when packed).
    Position t holds the log-probability of the token at t + 1 (labels are shifted inside sequence_logprobs): the
    same shift for the mask and the stored log-probabilities, which were computed the same way."""
    packed = _packed(rows)
    labels = rows["labels"] if packed is None else packed.unpack(packed.labels, fill=IGNORE_INDEX)
    return torch.nn.functional.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False).float()


def _packed(rows: dict[str, torch.Tensor]) -> PackedRows | None:
    """The packed rows of a batch `packed_rows` made (None for padded rows)."""
    if "packed_row_of" not in rows:
        return None
    return PackedRows(rows["input_ids"], rows["labels"], rows["position_ids"], rows["packed_row_of"],
                      rows["packed_start_of"], rows["packed_length_of"])


@contextlib.contextmanager
def _adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The model with its LoRA adapters off. The task holds the model as loaded, whose layers LoRA changed in place
    (the PEFT wrapper around it is the engine's), so the adapter layers are switched off one by one."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        wrapper = peft_model_of(model)
    except ValueError:
        wrapper = None
    if wrapper is not None:
        with wrapper.disable_adapter():
            yield
        return
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise RuntimeError("the adapters-off reference found no LoRA layers in the model")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    kept = values[~torch.isnan(values)]
    return kept.std() if kept.numel() > 1 else torch.zeros(())


ROLLOUT_COLUMNS = ("reward", "length", "truncated", "trained_tokens")
"""The columns of a rollout's table gathered from every rank (`_rollout_table`), one row a completion; each reward
function's values follow, in the order of the reward functions."""


def _rollout_table(scores: Any, rollout: Any, mask_truncated: bool) -> torch.Tensor:
    """One row a completion (ROLLOUT_COLUMNS, then each reward function's value), float64: the rewards round-trip."""
    trained = [0 if cut and mask_truncated else len(ids) for ids, cut in zip(rollout.completions, rollout.truncated,
                                                                             strict=True)]
    columns = [scores.total, torch.tensor([len(ids) for ids in rollout.completions]),
               torch.tensor(rollout.truncated), torch.tensor(trained), *scores.per_function.values()]
    return torch.stack([column.to(torch.float64) for column in columns], dim=1)


def _step_counts(everyone: torch.Tensor, start: int, mine: int) -> tuple[int, int]:
    """(completions, trained tokens) of the step on every rank together (rows `start` to `start + mine` are this
    rank's): what the loss is normalised by, at least 1 each."""
    return max(1, len(everyone)), max(1, int(everyone[:, ROLLOUT_COLUMNS.index("trained_tokens")].sum()))


def _summed_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the ranks of the process group (the values themselves in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    from memfit.distributed.context import summed_over_world

    return summed_over_world(values)


def _gathered_over_ranks(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's rows of `values` in rank order, and where this rank's begin (`values` and 0 in one process):
    one all_gather_object, which takes shares of any length."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values, 0
    shares: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, values.detach().cpu())
    rank = torch.distributed.get_rank()
    return torch.cat(shares).to(values.dtype), sum(len(share) for share in shares[:rank])


def _is_main_process() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0


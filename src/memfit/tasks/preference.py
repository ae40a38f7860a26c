"""Preference tasks: DPO, SimPO, ORPO and KTO, trained by memfit's own step (exact accumulation, OOM recovery).

A sample is one pair (prompt, chosen, rejected), or for KTO one labelled completion; `count` is 1 a sample, so the
step's loss is the mean over the pairs of the effective batch, as TRL's is over its batch (`--batch-size` counts
pairs). `collate` makes two rows of a sample: prompt + chosen and prompt + rejected (KTO: prompt + completion and
prompt + a mismatched completion, the rows of its KL estimate), all first rows, then all second rows (TRL's
concatenated layout), labels IGNORE_INDEX on the prompt and the padding. A pair is never split: OOM recovery splits
the list of samples, so both rows of a pair always meet in one micro-batch. Under --pair-layout shared-prompt (or
auto, where the model's attention kernel takes a 4D mask and the prompts are long enough) a pair is instead one row
that computes its prompt once (tasks/pair_layout.py), and under --pair-layout split the two rows' sides run as two
forwards, one side's activations at the peak (tasks/pair_split.py); the log-probabilities reach the objectives in the
two-row order every way, so the objectives do not know which layout ran.

The loss function runs the policy's log-probabilities of the completions chunk by chunk
(techniques/sequence_logprobs.py: no `[rows, length, vocabulary]` logits), takes the reference's
(techniques/reference_model.py: adapters off, a frozen copy, or cached before training), and returns the
objective's per-pair losses SUMMED (tasks/preference_losses.py has the formulas); the step divides by the pairs of
the effective batch. Terms that TRL averages over tokens rather than pairs (SimPO's `cpo_alpha` NLL, ORPO's NLL) are
made per-pair sums too: each pair's NLL is weighted by pairs / scored tokens of the effective batch (`prepare`
attaches the weight), so the step's sum divided by its pairs is the token-mean NLL of the whole effective batch,
whatever the split into micro-batches. Where TRL averages per micro-batch instead (gradient accumulation, or one
micro-batch a step), the two agree when the step has one micro-batch.

KTO's reference point z (its KL estimate) is the mean over a micro-batch of the mismatched completions' log-ratios,
as TRL computes it per device batch, so an OOM split of a KTO micro-batch changes z (a detached constant) for the
halves; the mismatched completion of each example is fixed with the data, TRL's way: within each run of
`--batch-size` items in data order, the previous item's completion.

Metrics under TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected; nll_loss, log_odds_ratio, log_odds_chosen, kl where the objective has them) are gathered per
micro-batch on the device; `step_metrics()` reads them once per step, weighted by the pairs each averaged, a
micro-batch that an OOM made redo counted once. Evaluation streams the same metrics (eval_rewards/..., ...).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.data.preferences import PreferenceDataset, load_preference_data
from memfit.distributed.reference_shards import shard_reference_copy
from memfit.tasks.pair_layout import (
    ADDITIVE_MASK,
    TWO_ROWS,
    PairLayout,
    as_two_rows,
    choose_pair_layout,
    collate_shared_prompt,
    every_token_labels,
    layout_inputs,
    shared_prompt_attention_mask,
    side_labels,
)
from memfit.tasks.pair_packing import (
    PackedPairs,
    PairPacking,
    choose_pair_packing,
    collate_packed_pairs,
    lengths_differ,
)
from memfit.tasks.pair_split import logprobs_in_two_forwards, split_refusals
from memfit.tasks.preference_losses import (
    PreferenceLoss,
)
from memfit.tasks.preference_metrics import METRIC_ORDER, PreferenceMetrics  # noqa: F401
from memfit.tasks.preference_samples import (  # noqa: F401
    PreferenceSamples,
    collate_preference,
    kl_partners,
    per_sample_values,
    two_row_sequences,
)
from memfit.tasks.sample_loss_task import SampleLossTask
from memfit.techniques.loss import IGNORE_INDEX, unwrap_causal_lm
from memfit.techniques.reference_model import (
    COPY_MODES,
    NO_REFERENCE,
    ReferenceChoice,
    ReferenceCost,
    adapters_off_logprobs,
    cache_key,
    choose_reference,
    copy_logprobs,
    item_share,
    load_cached,
    model_fingerprint,
    precompute_logprobs,
    reference_copy,
    save_cached,
    timed,
)
from memfit.techniques.reference_model import _peft_model as peft_model_of  # the PEFT model under any engine wrapper
from memfit.techniques.sequence_logprobs import SequenceLogprobs, model_logprob_chunk_tokens, sequence_logprobs
from memfit.techniques.streamed_reference import HOST_COPY, host_copy_problem, note_step, reference_pass

log = logging.getLogger("memfit")

PREFERENCE_SETTINGS = ("beta", "loss_type", "label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight",
                       "undesirable_weight", "reference", "precompute_ref_log_probs")
"""The task section's preference settings (config_sections.TaskConfig), each read by some of the objectives."""
REFERENCE_SETTINGS = ("reference", "precompute_ref_log_probs")


# -- the tasks --------------------------------------------------------------------------------------------------------


@dataclass
class ScoredRows:
    """A collated micro-batch as the loss function receives it, in either pair layout (tasks/pair_layout.py)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    chunk_size: int
    position_ids: torch.Tensor | None = None
    branches: torch.Tensor | None = None
    """shared-prompt rows: each token's branch (pair_layout.TRUNK, ...); None for two rows a pair."""
    mask_kind: str = ""
    """shared-prompt rows: the 4D mask the attention kernel takes (pair_layout.BOOLEAN_MASK, ADDITIVE_MASK)."""
    packing: PackedPairs | None = None
    """packed rows (tasks/pair_packing.py): where each sequence of the two-row layout lies; None when padded."""
    _shared_mask: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def shared(self) -> bool:
        return self.branches is not None

    @property
    def packed(self) -> bool:
        return self.packing is not None

    @property
    def pairs(self) -> int:
        """Samples in the batch: two rows each (two sequences packed), or one shared-prompt row each."""
        if self.packing is not None:
            return self.packing.sequences // 2
        return self.input_ids.shape[0] if self.shared else self.input_ids.shape[0] // 2

    def sides(self) -> tuple[ScoredRows, ScoredRows]:
        """Every sample's first row, and every second row, as batches of their own (KTO's matched and mismatched
        completions); packed rows were packed a side apart for it (tasks/pair_packing.py)."""
        count = self.pairs
        if self.packing is None:
            first, second = slice(0, count), slice(count, None)
            return (ScoredRows(self.input_ids[first], self.labels[first], _part(self.attention_mask, first),
                               self.chunk_size),
                    ScoredRows(self.input_ids[second], self.labels[second], _part(self.attention_mask, second),
                               self.chunk_size))
        return tuple(ScoredRows(self.input_ids[part], self.labels[part], None, self.chunk_size,
                                packing=self.packing.side(second))
                     for second, part in ((False, self.packing.side_rows(False)), (True, self.packing.side_rows(True))))

    def shared_mask(self, model: torch.nn.Module) -> torch.Tensor:
        """The shared-prompt rows' 4D attention mask, built once a micro-batch (the policy's and the reference's
        forwards read the same one); an additive mask has the dtype of the model's embeddings, as transformers'
        own eager mask."""
        if self._shared_mask is None:
            dtype = (unwrap_causal_lm(model).get_input_embeddings().weight.dtype if self.mask_kind == ADDITIVE_MASK
                     else torch.bool)
            self._shared_mask = shared_prompt_attention_mask(self.branches, self.mask_kind, dtype)
        return self._shared_mask

    def every_token_labels(self) -> torch.Tensor:
        """Labels that score every real token (ORPO's NLL reads them), in the rows' own layout."""
        if self.shared:
            return every_token_labels(self.input_ids, self.branches)
        if self.packing is not None:
            return self.packing.every_token_labels(self.input_ids)
        if self.attention_mask is None:
            return self.input_ids
        return self.input_ids.masked_fill(self.attention_mask == 0, IGNORE_INDEX)

    @property
    def answer_labels(self) -> torch.Tensor:
        """The answers' targets in the two-row layout's order, `[2 x pairs, length]` (chosen rows first): what
        `SequenceLogprobs.restricted_to` reads of `policy_logprobs`'s per-token values in any layout."""
        if self.packing is not None:
            return self.packing.unpacked(self.labels, IGNORE_INDEX)
        return side_labels(self.labels, self.branches) if self.shared else self.labels


@dataclass
class _PendingReference:
    """A cached reference's pass left for the ranks to share (PreferenceTask.after_data_loaded)."""

    samples: PreferenceSamples
    path: Path
    key: str
    parts: dict[str, Any]
    role: str
    why: str
    """Why no cache file served (for the log)."""


def _part(rows: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if rows is None else rows[part]


def _ranks_share_the_pass() -> bool:
    """Whether this process is one of several under torchrun (the cached reference's pass is then shared)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


class PreferenceTask(SampleLossTask):
    """A preference objective (module docstring): the causal LM's own head, a loss over pairs of completions."""

    auto_class = "AutoModelForCausalLM"
    unit = "pairs"
    sequence_level = True
    eval_metrics = ("rewards/accuracies", "rewards/margins")
    eval_count_field = "eval_samples"
    needs_reference = True
    """Whether the objective compares the policy with a frozen reference (DPO, KTO)."""
    settings_read: tuple[str, ...] = ("beta",)
    """The preference settings this objective reads; another objective's, given, are refused."""

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.step_metric_stream = PreferenceMetrics()
        self.reference_problem = ""
        self.reference_choice = ReferenceChoice(NO_REFERENCE, "not chosen yet")
        if config is not None:
            try:
                self.reference_choice = choose_reference(config.task.reference, config.task.precompute_ref_log_probs,
                                                         config.lora.lora_r > 0, self.needs_reference)
            except ValueError as error:
                self.reference_problem = str(error)
        self.reference_cost = ReferenceCost(self.reference_choice.mode, self.reference_choice.reason)
        self._model: torch.nn.Module | None = None
        self._pad_token_id: int | None = None
        self._copy: torch.nn.Module | None = None
        self.eval_reference_cost: ReferenceCost | None = None
        self._pending_references: list[_PendingReference] = []
        """cached: reference passes left for every rank to share once all have loaded the data (after_data_loaded)."""
        self.requested_pair_layout = getattr(config.task, "pair_layout", TWO_ROWS) if config is not None else TWO_ROWS
        self.pair_layout: PairLayout = choose_pair_layout(self.requested_pair_layout, None, self.name != "kto", None)
        """How the pairs are laid out (tasks/pair_layout.py): chosen when the training data is loaded, two rows until
        then."""
        self.requested_packing = str(config.data.packing) if config is not None else "off"
        self.pair_packing: PairPacking = choose_pair_packing(self.requested_packing, None, False)
        """Whether the micro-batches' sequences are packed (tasks/pair_packing.py): checked against the model when it
        is loaded and against the pair layout when the training data is."""

    # -- settings and refusals ------------------------------------------------------------------------------------

    def refusals(self, config: Any) -> list[str]:
        found = [self.reference_problem] if self.reference_problem else []
        if self.reference_choice.mode == HOST_COPY and host_copy_problem(config.distributed):
            found.append(host_copy_problem(config.distributed))
        if config.data.packing == "wrapped":
            found.append(f"--packing wrapped cuts samples across rows; --task {self.name} packs whole sequences: use"
                         " --packing samples, auto or off")
        if config.training.auto_batch_size:
            found.append(f"--auto-batch-size probes with causal-LM windows, not pairs; give --task {self.name} a"
                         " --batch-size (out-of-memory recovery splits it if it does not fit)")
        found += split_refusals(config)
        given = config.user_set or frozenset()
        for name in PREFERENCE_SETTINGS:
            if name in given and name not in self.settings_read:
                found.append(f"--{name.replace('_', '-')} does not apply to --task {self.name}; it reads "
                             + ", ".join(f"--{n.replace('_', '-')}" for n in self.settings_read))
        return found

    # -- the model and the data ------------------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, tokenizer: Any) -> None:
        # The loaded model, before any technique wraps it: the frozen copy is made of it, and the cached pass runs it.
        self._model = model
        self._pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pair_packing = choose_pair_packing(self.requested_packing, model, False)
        if self.reference_choice.mode in COPY_MODES:  # sharded like the policy under FSDP2 and ZeRO-3
            self._copy = shard_reference_copy(reference_copy(model, self.reference_cost), self.reference_cost,
                                              self.config)
        if self.reference_choice.mode not in ("cached", NO_REFERENCE):  # cached: said when its pass has run
            log.info("memfit: %s", self.reference_cost.describe())

    def load_data(self, data_config: Any, tokenizer: Any, *, role: str = "training", max_positions: int | None = None,
                  min_samples: int = 1, rope_positions: int | None = None, say: bool = True, **_: Any
                  ) -> PreferenceSamples:
        items = load_preference_data(data_config, tokenizer, task=self.name, max_positions=max_positions,
                                     min_samples=min_samples, rope_positions=rope_positions, say=say)
        partners = None if items.paired else kl_partners(len(items), self.config.training.batch_size)
        samples = PreferenceSamples(items, partners)
        samples.packing_facts = self._packing_facts
        if role == "training":
            self._choose_pair_layout(items, say)
        if self.reference_choice.mode == "cached":
            self._cache_reference(samples, Path(data_config.cache_dir or "."), role, say)
        return samples

    def _choose_pair_layout(self, items: PreferenceDataset, say: bool) -> None:
        """The pairs' layout for this run (training and evaluation alike), from the loaded model and the training
        data; said in the log (a warning where shared-prompt was asked for and two rows run) and in `facts`. Without
        the model (data read for a plan) nothing is chosen."""
        if self._model is None:
            return
        self.pair_layout = choose_pair_layout(self.requested_pair_layout, self._model, items.paired,
                                              getattr(items, "segment_lengths", None))
        self.pair_packing = choose_pair_packing(self.requested_packing, self._model, self.pair_layout.shared)
        if say:
            (log.warning if self.pair_layout.fell_back else log.info)("memfit: %s", self.pair_layout.describe())
            (log.warning if self.pair_packing.fell_back else log.info)("memfit: %s", self.pair_packing.describe())

    def _cache_reference(self, samples: PreferenceSamples, cache_dir: Path, role: str, say: bool) -> None:
        """Set `samples.reference` from the cache file when its key matches, else from one no-grad pass (saved); under
        torchrun the pass is left for every rank to share (after_data_loaded)."""
        from memfit.techniques.precision import run_precision

        if self._model is None:
            raise RuntimeError("the cached reference needs the model: call prepare_model before load_data")
        model = self._model
        device = next(model.parameters()).device
        precision = run_precision(self.config, device)
        parts = {"model": model_fingerprint(model, str(self.config.model.model)), "data": samples.fingerprint(),
                 "settings": {"task": self.name, "autocast": str(precision.autocast_dtype),
                              "template": samples.template_name, "seq_len": samples.seq_len}}
        key = cache_key(parts["model"], parts["data"], parts["settings"])
        path = cache_dir / f"reference-logps-{self.name}-{role}.safetensors"
        (values, why), seconds = timed(lambda: load_cached(path, key, parts))
        reused = values is not None and values.shape == (len(samples), 2)
        if not reused and _ranks_share_the_pass():
            # Under torchrun rank 0 loads the data while the others wait in a barrier: the pass waits until every
            # rank has the data (after_data_loaded), where each computes a share, rather than timing the barrier out.
            self._pending_references.append(_PendingReference(samples, path, key, parts, role, why))
            return
        if not reused:
            values, seconds = timed(lambda: self._reference_pass(samples, 0, len(samples)))
            save_cached(path, values, key, parts)
        cost = ReferenceCost("cached", self.reference_choice.reason, seconds=seconds, cache_file=str(path),
                             reused=reused, items=len(samples))
        self._set_reference(samples, values, cost, role, "" if reused else f" ({why})", say)

    def after_data_loaded(self, dist: Any) -> None:
        """The cached reference's pass over data no cache file held, shared by the ranks: each computes its
        contiguous share of the items, a sum over the ranks gathers them (exact: the other shares are zeros), and
        rank 0 writes the file."""
        pending, self._pending_references = self._pending_references, []
        for work in pending:
            items = len(work.samples)
            start, end = item_share(items, dist.rank, dist.world_size)
            values = torch.zeros(items, 2, dtype=torch.float32)
            share, seconds = timed(lambda work=work, start=start, end=end: self._reference_pass(work.samples, start, end))
            values[start:end] = share
            values = dist.all_reduce_tensor_sum(values)
            if dist.is_main:
                save_cached(work.path, values, work.key, work.parts)
            cost = ReferenceCost("cached", self.reference_choice.reason, seconds=seconds, cache_file=str(work.path),
                                 items=items, ranks=dist.world_size)
            self._set_reference(work.samples, values, cost, work.role, f" ({work.why})", dist.is_main)

    def _reference_pass(self, samples: PreferenceSamples, start: int, end: int) -> torch.Tensor:
        """`[end - start, 2]` reference log-probabilities of items start..end-1, in one streamed no-grad pass."""
        from memfit.techniques.precision import run_precision

        model = self._model
        device = next(model.parameters()).device
        precision = run_precision(self.config, device)
        return precompute_logprobs(
            model, end - start, lambda first, last: self._rows_of(samples, start + first, start + last), 2,
            batch_size=self.config.training.batch_size,
            chunk_size=self._chunk_size(0, model, 2 * self.config.training.batch_size * (self.config.data.seq_len or 1)),
            autocast=lambda: precision.autocast(device))

    def _set_reference(self, samples: PreferenceSamples, values: torch.Tensor, cost: ReferenceCost, role: str,
                       why: str, say: bool) -> None:
        samples.reference = values
        if role == "training":
            self.reference_cost = cost
        else:
            self.eval_reference_cost = cost
        if say:
            log.info("memfit: %s%s", cost.describe(), why)

    def _rows_of(self, samples: PreferenceSamples, start: int, end: int):
        batch = collate_preference([samples.tokens(index) for index in range(start, end)], self._pad_token_id)
        return batch["input_ids"], batch["labels"], batch["attention_mask"]

    def prepare(self, samples: list[dict], indices: Sequence[int], step: int) -> list[dict]:
        """The step's samples, each with its NLL weight where the objective has a token-mean NLL (module docstring):
        pairs / NLL targets of all of them, so the step's sum over pairs, divided by its pairs, is that token mean."""
        note_step(self._copy, step)  # host-copy: its streamed passes' time is reported a step
        tokens = sum(self.nll_targets(sample) for sample in samples)
        if not tokens:
            return samples
        weight = torch.tensor(len(samples) / tokens, dtype=torch.float32)
        return [{**sample, "nll_weight": weight} for sample in samples]

    def nll_targets(self, sample: dict) -> int:
        """Targets of the sample's share of a token-mean NLL term (0: the objective has none)."""
        return 0

    def collate(self, samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
        if samples and self.nll_targets(samples[0]) and "nll_weight" not in samples[0]:
            samples = self.prepare(list(samples), range(len(samples)), 0)  # not prepared (a probe): this micro-batch's
        if self.pair_layout.shared and samples and "chosen_ids" in samples[0]:
            return collate_shared_prompt(samples, pad_token_id) | per_sample_values(samples)
        rows = two_row_sequences(samples) if self.pair_packing.packed and samples else []
        if lengths_differ(rows):
            # a side a packing where the sides run apart: split's two forwards, KTO's mismatched rows without a graph
            sides_apart = self.pair_layout.split or "chosen_ids" not in samples[0]
            return collate_packed_pairs(rows, pad_token_id, sides_apart) | per_sample_values(samples)
        return collate_preference(samples, pad_token_id)

    # -- the loss --------------------------------------------------------------------------------------------------

    def loss_sum(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, chunk_size: int = 0, *, pair_index: torch.Tensor,
                 position_ids: torch.Tensor | None = None, **inputs: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed per-pair losses (the step divides by the effective batch's pairs); its metrics
        go to the step's stream (`step_metrics`)."""
        rows = self._rows(input_ids, labels, attention_mask, self._chunk_size(chunk_size, model, input_ids.numel()), position_ids,
                          inputs)
        total, result, weights = self.objective(model, rows, **inputs)
        self.step_metric_stream.add(pair_index, result.metrics, weights)
        return total

    def _rows(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
              chunk_size: int, position_ids: torch.Tensor | None, inputs: dict[str, Any]) -> ScoredRows:
        """The micro-batch's rows; a shared-prompt batch's branches and positions are taken out of `inputs`."""
        branches, positions = layout_inputs(inputs)
        packing = PackedPairs.taken_from(inputs)
        if packing is not None:
            return ScoredRows(input_ids, labels, None, chunk_size, packing=packing)
        if branches is None:
            return ScoredRows(input_ids, labels, attention_mask, chunk_size, position_ids)
        return ScoredRows(input_ids, labels, None, chunk_size, positions, branches, self.pair_layout.mask)

    def objective(self, model: torch.nn.Module, rows: ScoredRows, **inputs: torch.Tensor
                  ) -> tuple[torch.Tensor, PreferenceLoss, dict[str, Any]]:
        """(the summed loss, the objective's PreferenceLoss, each metric's weight) of one micro-batch."""
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        """The TRL-named metrics of the training micro-batches run since the last call, weighted by pairs (one read
        from the device), then forgotten: what the step's metrics line carries (rewards/chosen, ...)."""
        return self.step_metric_stream.result()

    def metric_stream(self) -> PreferenceMetrics:
        return PreferenceMetrics()

    def eval_loss_sum(self, model: torch.nn.Module, batch: dict, stream: PreferenceMetrics) -> torch.Tensor:
        """An eval batch's summed per-pair losses, its metrics added to `stream`."""
        inputs = {name: value for name, value in self.loss_inputs(batch).items() if name != "pair_index"}
        rows = self._rows(batch["input_ids"], batch["labels"], batch.get("attention_mask"),
                          self._chunk_size(0, model, batch["input_ids"].numel()),
                          batch.get("position_ids"), inputs)
        total, result, weights = self.objective(model, rows, **inputs)
        stream.add(batch["pair_index"], result.metrics, weights)
        return total

    def _chunk_size(self, given: int, model: torch.nn.Module, tokens: int) -> int:
        # Always chunked: a preference batch is two rows a pair, and its vocabulary logits are never built whole;
        # unless --loss-chunk-size says, a chunk's logits are about the size of the batch's hidden states.
        configured = self.config.memory.loss_chunk_size if self.config is not None else None
        return given if given > 0 else model_logprob_chunk_tokens(model, tokens, configured)

    def policy_logprobs(self, model: torch.nn.Module, rows: ScoredRows, labels: torch.Tensor | None = None,
                        per_token: bool = False):
        """`model`'s log-probabilities of `labels` (default: the answers), in the two-row layout's order whatever the
        rows' layout: `[2 x pairs]`, every chosen row then every rejected row (shared-prompt rows always carry the
        per-token values: `pair_layout.as_two_rows` splits them)."""
        labels = rows.labels if labels is None else labels
        if rows.packing is not None:
            return self._packed_logprobs(model, rows, labels)
        if not rows.shared:
            def score(part: slice):
                return sequence_logprobs(model, rows.input_ids[part], labels[part], _part(rows.attention_mask, part),
                                         chunk_size=rows.chunk_size, position_ids=_part(rows.position_ids, part),
                                         per_token=per_token)

            return logprobs_in_two_forwards(score, rows.pairs) if self.pair_layout.split else score(slice(None))
        scored = sequence_logprobs(model, rows.input_ids, labels, rows.shared_mask(model), chunk_size=rows.chunk_size,
                                   position_ids=rows.position_ids, per_token=True)
        return as_two_rows(scored.per_token, labels, rows.branches)

    def _packed_logprobs(self, model: torch.nn.Module, rows: ScoredRows, labels: torch.Tensor) -> SequenceLogprobs:
        """`policy_logprobs` of packed rows: scored packed (each side's rows in a forward of its own under split),
        laid out in the two-row order with their per-token values (tasks/pair_packing.py)."""
        def score(part: slice) -> SequenceLogprobs:
            return sequence_logprobs(model, rows.input_ids[part], labels[part], None, chunk_size=rows.chunk_size,
                                     position_ids=rows.packing.position_ids[part], per_token=True)

        first_side_rows = rows.packing.first_side_rows
        if self.pair_layout.split and first_side_rows is not None:
            scored = logprobs_in_two_forwards(score, first_side_rows)
        else:
            scored = score(slice(None))
        return rows.packing.two_rows(scored.per_token, labels)

    def reference_sums(self, model: torch.nn.Module, rows: ScoredRows, cached: torch.Tensor | None) -> torch.Tensor:
        """`[2 x pairs]` reference log-probabilities of the batch's answers, in the two-row order (no gradient)."""
        if cached is not None:  # [samples, 2] -> every sample's first row, then every second
            return cached.t().reshape(-1).float()
        mode = self.reference_choice.mode
        own_layout = rows.shared or rows.packed  # rows the plain reference functions do not read: scored as the policy's
        if own_layout and mode == "adapters-off":
            with torch.no_grad(), peft_model_of(model).disable_adapter():
                return self.policy_logprobs(model, rows).sums
        if own_layout and mode in COPY_MODES and self._copy is not None:
            with torch.no_grad(), reference_pass(self._copy):
                return self.policy_logprobs(self._copy, rows).sums
        if mode == "adapters-off":
            return adapters_off_logprobs(model, rows.input_ids, rows.labels, rows.attention_mask, rows.chunk_size)
        if mode in COPY_MODES and self._copy is not None:
            return copy_logprobs(self._copy, rows.input_ids, rows.labels, rows.attention_mask, rows.chunk_size)
        raise RuntimeError(f"--task {self.name}: no reference log-probabilities for this batch (reference {mode})")

    # -- what the run says ---------------------------------------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        facts = super().facts() | {
            "objective": self.name,
            "settings": {name: getattr(self.config.task, name) for name in self.settings_read
                         if name not in REFERENCE_SETTINGS} if self.config is not None else {},
            "reference": self.reference_cost.facts(),
            "packing": self._packing_words(),
            "pair_layout": self.pair_layout.facts(),
        }
        if self.eval_reference_cost is not None:
            facts["eval_reference"] = self.eval_reference_cost.facts()
        return facts

    def _packing_words(self) -> str:
        """The task facts' packing entry: packed (tasks/pair_packing.py), or padded and why."""
        if self.pair_packing.packed:
            return self.pair_packing.facts()
        rows = "one row of its own (the prompt once, both answers)" if self.pair_layout.shared else "two rows of their own"
        return f"off ({self.pair_packing.reason}): each pair runs as {rows}, padded to the longest of its micro-batch"

    def _packing_facts(self) -> dict[str, Any]:
        """The run's packing facts (techniques/packed_attention.py `packing_facts`): what packed the micro-batches."""
        packing = self.pair_packing
        return {"mode": packing.mode, "requested": packing.requested, "reason": packing.reason,
                "unit": "each micro-batch's sequences"}

    def describe(self) -> str:
        return f"{self.name} ({self.auto_class}; loss per {self.unit.removesuffix('s')}; {self.reference_cost.describe()})"

    @classmethod
    def describe_data(cls, facts: dict[str, Any]) -> str:
        """Preference data facts (PreferenceDataset.data_facts) in words: the report's data row."""
        noun = "pairs" if facts.get("paired", True) else "completions"
        template = f", template {facts['chat_template']}" if facts.get("chat_template") else ""
        text = (f"{facts.get('format')}{template}: {facts.get('samples_kept', 0):,} of {facts.get('items', 0):,} {noun}"
                f" of <= {facts.get('seq_len')} tokens a sequence, {facts.get('target_tokens', 0):,} of"
                f" {facts.get('tokens', 0):,} tokens scored (the completions)")
        cost = []
        if facts.get("samples_dropped_long"):
            cost.append(f"{facts['samples_dropped_long']:,} longer than {facts.get('seq_len')} tokens dropped")
        if facts.get("samples_truncated"):
            cost.append(f"{facts['samples_truncated']:,} cut to {facts.get('seq_len')} tokens")
        return text + ("; " + ", ".join(cost) if cost else "")

"""A preference step (DPO, SimPO, ORPO, KTO: memfit.tasks.preference) as the estimator counts it.

What differs from causal-LM training on --batch-size windows, and what the estimator's phases are told here:

- **Two rows a pair.** `--batch-size` counts pairs, as training does, and a pair runs as two rows of its own
  (prompt + chosen, prompt + rejected), each up to --seq-len tokens: the policy keeps the activations of
  2 x --batch-size rows (`PreferenceStep.rows`). KTO's second row of an example (the mismatched completion of its
  KL estimate) runs without a graph: its policy keeps one row an example and runs one more without keeping it.
- **The log-probabilities, a chunk at a time** (techniques/sequence_logprobs.py), over every position of every
  row, whatever --loss-chunk-size says (0 or unset: DEFAULT_LOSS_CHUNK_TOKENS): never the `[rows, length,
  vocabulary]` logits, at most one chunk's. Forward holds a chunk's logits, their fp32 copy under 16-bit compute
  and the fp32 log-softmax (`chunk_forward_bytes`); backward holds a chunk's log-softmax and two gradients of its
  size, and the in-place head gradient's backward its recomputed logits too (`head_working_bytes`).
- **The reference** (techniques/reference_model.py), the one the run would choose (`choose_reference`): `copy`
  keeps a frozen copy of the weights as loaded (no gradients, no optimizer state: `reference_copy_bytes`), a share a
  rank under fsdp and zero3 as the policy's (the estimator divides it), else whole on every rank; `copy` and `adapters-off` run a no-grad forward of every row of the micro-batch
  after the policy's, while all the policy's activations are kept (`no_grad_forward_bytes`: its largest moment, a
  block's MLP or the last chunk of logits); `host-copy` keeps the copy in host memory and runs the same forward
  with one unit's weights beside it (`StreamedUnits`: a block, or the head during its chunks; two blocks where
  CUDA prefetches); `cached` has no copy and no forward in the step, and `none` (SimPO,
  ORPO) no reference. KTO's policy runs its mismatched rows without a graph at the same moment.

Every term was fitted to and checked against the tracked peak of memfit's real step on CPU
(tests/unit/prediction/test_preference_estimate.py).

The layout is two rows a pair, in one forward or, under `--pair-layout split`, two (tasks/pair_split.py): the chosen
rows' graph is kept, the rejected rows' forward keeps nothing until their backward runs it again, after the chosen
rows' backward has freed its activations, so the policy keeps one row a pair at the peak (`trained_rows` 1) and the
step runs the rejected rows' forward once more (`pair_forwards_again`, the speed model's). The reference still runs
both sides in one no-grad forward. `--pair-layout shared-prompt` (or auto) computes a long prompt once and holds
less, by how much the prompts' lengths decide, which an estimate does not read; two rows is the larger case. The
planner tries split where one forward does not fit (`pair_layout_lever`).

Packed (`--packing samples` or auto, tasks/pair_packing.py), a micro-batch's sequences lie end to end in rows as wide
as its longest. With --dataset the estimate reads the pair lengths (`data_pair_lengths`), takes the micro-batch of the
--batch-size pairs with the most tokens, places its sequences by best-fit decreasing into rows of --seq-len tokens
(`packed_pair_rows`; each side apart under split and for KTO, as the run does) and counts those rows where it counts
`2 x pairs` padded ones, with SDPA's block mask over them (`packed_mask_bytes`). Without --dataset every sequence is
taken at --seq-len, which leaves nothing to pack: the padded rows. Within 5 % of the tracked peak of the real packed
step on pairs of mixed lengths (tests/unit/tasks/test_preference_packing.py).

The traced estimate and the tests' measured step run the real task on pairs of --seq-len rows
(`traced_sample_maker`), the frozen copy made as a training run makes it (`prepare_traced_model`). On fake tensors a trained head's chunk backward is counted one
`[chunk, vocabulary]` tensor short of what the real CPU kernels hold (the causal LM's chunked loss alike), so the
traced estimate is low where that backward is the peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memfit.prediction.activations import Architecture, Precision
from memfit.prediction.chunked_head import in_place_head_runs

PER_STEP_REFERENCES = ("copy", "host-copy", "adapters-off")
"""References that run a forward in every micro-batch (cached ran before training; none has none)."""

CHUNK_BACKWARD_BYTES = 12
"""Bytes a chunk's backward holds a token and vocabulary entry whatever the compute dtype: the fp32 log-softmax, the
per-token NLL's gradient and the log-softmax's (tracked on CPU); the in-place head's adds the recomputed logits."""

TARGET_BYTES_PER_TOKEN = 16
"""A log-probability pass's own per-token tensors beside the model's: the shifted int64 targets and the fp32
per-token values (tracked: 12-28 bytes a token)."""


def is_preference(task: Any) -> bool:
    """Whether `task` (an instance or class of memfit.tasks) learns from preference pairs."""
    from memfit.tasks.preference import PreferenceTask

    return isinstance(task, PreferenceTask) or (isinstance(task, type) and issubclass(task, PreferenceTask))


@dataclass(frozen=True)
class PreferenceStep:
    """What a preference task's micro-batch runs, as the estimator counts it (module docstring)."""

    task: str
    reference: str
    """none, adapters-off, copy, host-copy or cached (techniques.reference_model.choose_reference)."""
    reference_note: str
    """Why this reference, or why the one asked for cannot run and which was estimated instead."""
    trained_rows: int
    """Rows a sample the policy runs with a graph: 2 (KTO: 1)."""
    untrained_rows: int
    """Rows a sample the policy runs without a graph (KTO's mismatched completions: 1)."""
    chunk_tokens: int
    """Tokens a chunk of the log-probabilities: --loss-chunk-size, or 0 for the task's own rule
    (techniques/sequence_logprobs.py `logprob_chunk_tokens`: a chunk's logits about the size of the hidden states)."""
    layout_note: str = "two rows a pair"
    """The pair layout estimated, and why where another was asked for."""
    forwards: int = 1
    """Forwards a pair's rows take: 1, or 2 under --pair-layout split (the chosen rows', then the rejected rows')."""
    streamed: StreamedUnits | None = None
    """--reference host-copy: the weight bytes its streamed forward brings to the device (`with_streamed_reference`)."""
    packed: PackedPairRows | None = None
    """--packing samples with the data's pair lengths known: the packed rows of a micro-batch; None: padded rows."""

    @property
    def reference_rows(self) -> int:
        """Rows a sample the reference's forward runs in the step (every row of a pair; 0 when cached or none)."""
        return 2 if self.reference in PER_STEP_REFERENCES else 0

    def rows(self, samples: int) -> int:
        """Rows the policy keeps activations for in a micro-batch of `samples` pairs (or KTO examples)."""
        return self.packed.trained if self.packed is not None else samples * self.trained_rows

    def _no_grad_rows(self, samples: int) -> tuple[int, int]:
        """(rows of the reference's forward, rows the policy runs without a graph) in a micro-batch of `samples`."""
        if self.packed is None:
            return samples * self.reference_rows, samples * self.untrained_rows
        return (self.packed.every if self.reference in PER_STEP_REFERENCES else 0), self.packed.untrained

    def packed_mask_bytes(self, run: Any, arch: Architecture, element_bytes: int, seq_len: int) -> int:
        """What SDPA's block mask of the packed rows adds (techniques/packed_attention.py `block_mask_bytes`), over
        the rows the policy keeps: 0 when padded, or when no row holds two sequences (no mask is built then)."""
        from memfit.techniques.packed_attention import block_mask_bytes

        if self.packed is None or not self.packed.shares_rows:
            return 0
        holding = 1 if run.checkpointing == "full" else arch.layers
        expanded = 2 * max(0, arch.q_width - arch.kv_width) * element_bytes
        return block_mask_bytes(self.packed.trained, seq_len, run.attention, holding, element_bytes, expanded)

    def chunk_forward_bytes(self, arch: Architecture, precision: Precision, tokens: int) -> float:
        """What one chunk holds while its log-probabilities are computed, of a pass over `tokens` tokens: the fp32
        logits and their fp32 log-softmax. Logits in a 16-bit compute dtype are let go once their fp32 copy is made
        (sequence_logprobs.token_target_logprobs rebinds them: at most 2 + 4 bytes an entry then, fewer than 8)."""
        return float(8 * self.chunk_of(arch, tokens) * arch.vocab)

    def chunk_of(self, arch: Architecture, tokens: int) -> int:
        """Tokens of the largest chunk of a pass over `tokens` tokens, as the task sizes it."""
        from memfit.techniques.sequence_logprobs import logprob_chunk_tokens

        return min(logprob_chunk_tokens(arch.vocab, arch.hidden, tokens, self.chunk_tokens), tokens)

    def head_working_bytes(self, run: Any, arch: Architecture, precision: Precision, tokens: int, head_grad: float,
                           sharding: str) -> float:
        """What the log-probabilities' backward holds beside the trained head's gradient (`head_grad`, 0 when the
        head is frozen) and every kept activation, before any block's gradient: the estimator's head sums.

        A chunk's backward holds the fp32 log-softmax, the per-token NLL's gradient and the log-softmax's, each
        `[chunk, vocabulary]` (12 bytes a token and vocabulary entry); the in-place head gradient's backward
        (a trained plain head) holds the recomputed logits in the compute dtype beside them, where the checkpointed
        chunks (a frozen head, under LoRA) have let them go (tracked on CPU in fp32, bf16 and bf16 autocast: 16,
        14 and 12 bytes). The in-place head gradient is made after the first chunk's tensors are freed: with one
        chunk it is never beside them. Checkpointed chunks of a trained head (a sharded or quantized head) add
        each chunk's head-sized gradient to the sum out of place: two head-sized tensors more, as for the chunked
        loss.
        """
        in_place = head_grad and in_place_head_runs(run, sharding)
        chunk = self.chunk_of(arch, tokens)
        per_entry = CHUNK_BACKWARD_BYTES + (precision.compute if in_place else 0)
        if not head_grad and chunk < tokens:
            # a frozen head's checkpointed chunks, one after another: the recomputed chunk's log-softmax and its
            # gradient, the NLL's gradient already gone (tracked on CPU, fp32, 64-token chunks of a 4,096-entry head:
            # 8 bytes; tests/unit/prediction/test_preference_estimate.py, adapters-off)
            per_entry = CHUNK_BACKWARD_BYTES - 4
        working = float(per_entry * chunk * arch.vocab)
        working += precision.residual * arch.hidden * tokens  # the final hidden states' gradient
        if run.autocast and run.weight_bytes == 4:  # each chunk casts the fp32 head anew: no autocast cache there
            working += precision.compute * arch.vocab * arch.hidden
        if not head_grad:  # a frozen head: no gradient to wait beside
            return working
        if not in_place:
            return working + 2.0 * head_grad
        return max(0.0, working - head_grad) if self.chunk_of(arch, tokens) >= tokens else working

    def forward_extra_bytes(self, arch: Architecture, precision: Precision, samples: int, seq_len: int) -> float:
        """The largest moment of the forward beyond the kept activations: the policy's chunk of logits, or later in
        the same loss the reference's no-grad forward (and KTO's mismatched rows), all of the policy's activations
        kept meanwhile; the estimator's forward "logits" term."""
        policy = self.chunk_forward_bytes(arch, precision, self.rows(samples) * seq_len)
        reference_rows, untrained_rows = self._no_grad_rows(samples)
        reference = no_grad_forward_bytes(self, arch, precision, reference_rows * seq_len, self.streamed)
        untrained = no_grad_forward_bytes(self, arch, precision, untrained_rows * seq_len)
        return max(policy, reference, untrained)

    def waiting_gradient_bytes(self, gradients: float) -> float:
        """What waits beside the step's kept tensors while the rejected rows run again under --pair-layout split:
        the chosen rows' gradient of every trained parameter (`gradients`, all of them), held by autograd until the
        rejected rows' gradient joins it (tasks/pair_split.py); 0 in one forward."""
        return gradients if self.forwards == 2 else 0.0

    def details(self, copy: float) -> dict[str, Any]:
        """What the estimate's details say about the preference step."""
        return {"preference": {"task": self.task, "reference": self.reference, "reference_reason": self.reference_note,
                               "rows_per_sample": 2 if self.forwards == 2 else self.trained_rows + self.untrained_rows,
                               "forwards": self.forwards, "layout": self.layout_note,
                               "logprob_chunk_tokens": self.chunk_tokens, "reference_copy_bytes": int(copy),
                               **(self.streamed.details() if self.streamed is not None else {}),
                               **(self.packed.details() if self.packed is not None else {})}}


def preference_step(config: Any, run: Any) -> PreferenceStep | None:
    """The preference step of `config` as resolved to `run`, or None for a task that does not learn from pairs."""
    from memfit.tasks import TASK_CLASSES
    from memfit.tasks.pair_layout import SPLIT, TWO_ROWS
    from memfit.techniques.reference_model import choose_reference

    task_class = TASK_CLASSES[config.task.task]
    if not is_preference(task_class):
        return None
    lora = run.lora_r > 0
    task = config.task
    try:
        choice = choose_reference(task.reference, task.precompute_ref_log_probs, lora, task_class.needs_reference)
        note = choice.reason
    except ValueError as error:
        # training refuses this; a plan's other candidates (full training under --reference adapters-off) are
        # estimated with the reference the run would choose by itself
        choice = choose_reference("auto", False, lora, task_class.needs_reference)
        note = f"{error}: estimated with {choice.mode}"
    kto = task_class.name == "kto"
    chunk = config.memory.loss_chunk_size or 0  # the task's own (run.loss_chunk_size is the causal-LM loss's)
    requested = getattr(task, "pair_layout", TWO_ROWS)
    split = requested == SPLIT and not kto
    layout = "two rows a pair"
    if split:
        layout += " in two forwards (--pair-layout split): one side's activations at the peak"
    elif requested != TWO_ROWS and not kto:
        layout += (f" (--pair-layout {task.pair_layout} shares long prompts: less, by what the prompts' lengths"
                   " decide, which an estimate does not read)")
    trained = 1 if kto or split else 2
    packed = packed_pair_rows(config, task_class.name, split or kto)
    if packed is not None:
        layout += f", packed: {packed.describe()}"
    return PreferenceStep(task_class.name, choice.mode, note, trained, 1 if kto else 0, chunk, layout,
                          2 if split else 1, packed=packed)


@dataclass(frozen=True)
class PackedPairRows:
    """A packed micro-batch as the estimate counts it (tasks/pair_packing.py): the sequences of the --batch-size
    pairs of the data with the most tokens (the micro-batch that holds the most), placed by best-fit decreasing into
    rows of --seq-len tokens; each side apart under --pair-layout split and for KTO, as the run packs them."""

    trained: int
    """Rows the policy keeps a graph for: every row, or the larger side's rows where the sides run apart."""
    every: int
    """Rows of both sides (what the reference's no-grad forward runs)."""
    untrained: int
    """KTO: the mismatched completions' rows, run without a graph; else 0."""
    sequences: int
    """Sequences in the micro-batch (two a pair)."""
    tokens: int
    """Their tokens, the sum of the sequences' lengths."""

    @property
    def shares_rows(self) -> bool:
        """Whether some row holds two sequences (only then does the model build a block mask)."""
        return self.every < self.sequences

    def describe(self) -> str:
        return (f"{self.sequences} sequences ({self.tokens:,} tokens) in {self.every} rows, the policy keeping"
                f" {self.trained}")

    def details(self) -> dict[str, int]:
        return {"packed_rows": self.trained, "packed_rows_every_side": self.every, "packed_sequences": self.sequences,
                "packed_tokens": self.tokens}


def packed_pair_rows(config: Any, task: str, sides_apart: bool,
                     pair_lengths: np.ndarray | None = None) -> PackedPairRows | None:
    """The packed rows of `config`'s preference micro-batch (`PackedPairRows`), or None where the run pads: --packing
    off, or the pair lengths unknown (no --dataset: every sequence taken at --seq-len, which leaves nothing to pack).
    `pair_lengths`: `[pairs, 3]` prompt, chosen and rejected (KTO: `[items, 2]` prompt, completion) token counts;
    default: read from --dataset (`data_pair_lengths`)."""
    from memfit.data.packing import best_fit_decreasing

    packing = config.data.packing
    if packing is False or packing in ("off", "wrapped"):
        return None
    lengths = data_pair_lengths(config, task) if pair_lengths is None else np.asarray(pair_lengths, dtype=np.int64)
    if lengths is None or not len(lengths):
        return None
    width, batch = int(config.data.seq_len), max(1, int(config.training.batch_size))
    if lengths.shape[1] == 2:  # KTO: each item's mismatched completion is its neighbour's (tasks/preference_samples.py)
        lengths = np.stack([lengths[:, 0], lengths[:, 1], np.roll(lengths[:, 1], 1)], axis=1)
    heaviest = lengths[np.argsort(-(2 * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]), kind="stable")[:batch]]
    first = np.minimum(heaviest[:, 0] + heaviest[:, 1], width)
    second = np.minimum(heaviest[:, 0] + heaviest[:, 2], width)
    if sides_apart:
        first_rows, second_rows = len(best_fit_decreasing(first, width)), len(best_fit_decreasing(second, width))
        every = first_rows + second_rows
        trained, untrained = (first_rows, second_rows) if task == "kto" else (max(first_rows, second_rows), 0)
    else:
        every = trained = len(best_fit_decreasing(np.concatenate([first, second]), width))
        untrained = 0
    return PackedPairRows(trained, every, untrained, 2 * len(heaviest), int(first.sum() + second.sum()))


_PAIR_LENGTHS: dict[str, np.ndarray | None] = {}
"""The pair lengths read for an estimate, by what they were read from (the planner estimates many candidates)."""


def data_pair_lengths(config: Any, task: str) -> np.ndarray | None:
    """The token counts of the pairs of --dataset (`PreferenceDataset.segment_lengths`), read with the model's
    tokenizer as training reads them; None without a dataset or where it cannot be read here."""
    data = config.data
    if not data.dataset:
        return None
    key = repr((data, config.model.model, config.model.tokenizer, task))
    if key not in _PAIR_LENGTHS:
        from memfit.data.preferences import load_preference_data
        from memfit.errors import UsageError
        from memfit.models.loader import load_tokenizer

        name = config.model.tokenizer or config.model.model
        try:
            tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
            _PAIR_LENGTHS[key] = load_preference_data(data, tokenizer, task=task, say=False).segment_lengths
        except (OSError, ValueError, UsageError):  # the estimate then counts padded rows, every one --seq-len long
            _PAIR_LENGTHS[key] = None
    return _PAIR_LENGTHS[key]


def reference_lever(config: Any, mode: str, given: Callable[[str], bool]) -> dict[str, Any]:
    """The plan's other reference for a run whose reference would be a frozen copy: `--reference cached` (its
    log-probabilities computed once before training: no copy on the device and no reference forward a step), or
    nothing (another task; LoRA, whose adapters-off reference is already free; a reference the user chose).

    `mode`: 'full', 'lora' or 'qlora'; `given(name)`: whether the user set that setting. The pair layout is
    `pair_layout_lever`'s (split; not shared-prompt, whose saving the prompts' lengths decide, which an estimate
    does not read).
    """
    from memfit.tasks import TASK_CLASSES
    from memfit.techniques.reference_model import choose_reference

    task_class = TASK_CLASSES[config.task.task]
    if not is_preference(task_class) or mode != "full" or given("reference") or given("precompute_ref_log_probs"):
        return {}
    if choose_reference("auto", False, False, task_class.needs_reference).mode != "copy":
        return {}
    return {"reference": "cached"}


def pair_layout_lever(config: Any, given: Callable[[str], bool]) -> dict[str, Any]:
    """The plan's other pair layout: `--pair-layout split` (two forwards a micro-batch, one side's activations at
    the peak, the rejected rows' forward once more) for DPO, SimPO and ORPO, or nothing (another task, KTO, a layout
    the user chose). The planner ranks it by speed, so it runs only where one forward does not fit."""
    from memfit.tasks import TASK_CLASSES
    from memfit.tasks.pair_split import unchecked_engine

    task_class = TASK_CLASSES[config.task.task]
    if not is_preference(task_class) or task_class.name == "kto" or given("pair_layout"):
        return {}
    return {} if unchecked_engine(config.distributed) else {"pair_layout": "split"}


def pair_forwards_again(changes: dict[str, Any], config: Any) -> float:
    """The share of a pair's forward the step runs again (the speed model's): half, the rejected rows', under
    `--pair-layout split` (in `changes`, else the config's) for a paired preference task, else 0."""
    from memfit.tasks import TASK_CLASSES

    task_class = TASK_CLASSES[config.task.task]
    layout = changes.get("pair_layout", getattr(config.task, "pair_layout", ""))
    return 0.5 if layout == "split" and is_preference(task_class) and task_class.name != "kto" else 0.0


@dataclass(frozen=True)
class StreamedUnits:
    """What `--reference host-copy` (techniques/streamed_reference.py) holds: its whole copy in host memory, and on
    the device one unit's weights at a time while its forward runs (two in a row where CUDA prefetches the next)."""

    block: float
    """Weight bytes on the device while a block runs: one block, two with the prefetch."""
    head: float
    """Weight bytes on the device while the head's chunks run (the head, held for all of them); the embedding's
    moment (with the first block under the prefetch) is no larger where the head is at least a block."""
    host: float
    """Bytes of the whole copy in host memory (pinned on CUDA)."""

    def details(self) -> dict[str, int]:
        return {"reference_host_bytes": int(self.host), "reference_streamed_bytes": int(max(self.block, self.head))}


def streamed_units(hf_config: Any, copy_bytes: float, weight_bytes: int, prefetch: bool) -> StreamedUnits:
    """The units of a host-copy reference of `copy_bytes` bytes (the weights as loaded, `weight_bytes` an element):
    the embedding and the head `vocabulary x hidden` each (one host tensor when tied, brought for each), the final
    norm `hidden`, and the rest shared evenly by the blocks."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    vocab, hidden, layers = int(text.vocab_size), int(text.hidden_size), max(1, int(text.num_hidden_layers))
    table = float(vocab * hidden * weight_bytes)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    block = max(0.0, copy_bytes - table * (1 if tied else 2) - hidden * weight_bytes) / layers
    return StreamedUnits(block=block * (2 if prefetch else 1), head=table, host=float(copy_bytes))


def with_streamed_reference(step: PreferenceStep | None, hf_config: Any, loaded_parameters: float,
                            trainable_count: int, run: Any) -> PreferenceStep | None:
    """`step` with the units of its host-copy reference (prefetched on CUDA), unchanged for any other reference."""
    if step is None or step.reference != "host-copy" or hf_config is None:
        return step
    copy = loaded_parameters - (4 * trainable_count if run.lora_r else 0)
    units = streamed_units(hf_config, copy, run.weight_bytes, run.device_type == "cuda")
    return dataclasses.replace(step, streamed=units)


def micro_batch_rows(batch_size: int, step: PreferenceStep | None) -> int:
    """Rows of a micro-batch of `batch_size` samples that the model keeps activations for: the samples themselves,
    or the rows of a preference step's pairs."""
    return batch_size if step is None else step.rows(batch_size)


def no_grad_forward_bytes(step: PreferenceStep, arch: Architecture, precision: Precision, tokens: int,
                          streamed: StreamedUnits | None = None) -> float:
    """The most a no-grad forward of `tokens` tokens holds at once beside what the step already keeps (0 for none).

    A block keeps nothing: its largest moment is the MLP's (the activation's output, the up projection and their
    product, `intermediate` wide in the compute dtype) beside the residual stream's tensors (its input, the norm's
    output, the attention's output and the sum: four `hidden` wide in the residual dtype). After the blocks, one
    chunk of logits beside the final hidden states and their scored positions' copy (sequence_logprobs gathers
    the rows with a target). Tracked on CPU (fp32, bf16 autocast, bf16 weights; hidden 64-256, intermediate
    256-1,024): within 4 % of each. A streamed reference (`streamed`) has the running unit's weights beside each
    moment.
    """
    if tokens <= 0:
        return 0.0
    block = (3 * precision.compute * arch.intermediate + 4 * precision.residual * arch.hidden) * tokens
    head = step.chunk_forward_bytes(arch, precision, tokens) + 2 * precision.residual * arch.hidden * tokens
    if streamed is not None:
        block, head = block + streamed.block, head + streamed.head
    return float(max(block, head) + TARGET_BYTES_PER_TOKEN * tokens)


def reference_copy_bytes(step: PreferenceStep | None, loaded_parameters: float, trainable_count: int,
                         lora_r: int) -> float:
    """Bytes of the frozen copy `--reference copy` keeps: the weights as loaded, before LoRA adds its adapters (0
    for any other reference: host-copy's weights reach the device one unit at a time, `StreamedUnits`)."""
    if step is None or step.reference != "copy":
        return 0.0
    return float(loaded_parameters - (4 * trainable_count if lora_r else 0))


# -- the traced step's pairs -------------------------------------------------------------------------------------------


def traced_sample_maker(task: Any) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """`make_sample(input_ids)` for tracing (or measuring) a preference step without its data: one pair a sample,
    both of its rows `input_ids` long (the first half the prompt, then the answer; the other answer is the first one
    reversed), as PreferenceSamples gives them; KTO's examples alternately desirable; with reference log-probabilities
    when the reference is cached (they are read from the samples, not computed in the step)."""
    paired = task.name != "kto"
    cached = task.reference_choice.mode == "cached"
    made = [0]

    def make_sample(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        index = made[0]
        made[0] += 1
        half = max(1, input_ids.numel() // 2)
        prompt, answer = input_ids[:half], input_ids[half:]
        other = answer.flip(0)
        sample = {"input_ids": torch.cat([prompt, answer, prompt, other]), "prompt_ids": prompt,
                  "index": torch.tensor(index)}
        if paired:
            sample |= {"chosen_ids": answer, "rejected_ids": other}
        else:
            sample |= {"completion_ids": answer, "kl_completion_ids": other, "desirable": torch.tensor(index % 2 == 0)}
        if cached:
            sample["reference_logps"] = torch.full((2,), -float(answer.numel()), dtype=torch.float32)
        return sample

    return make_sample


def prepare_traced_model(task: Any, model: torch.nn.Module, device: torch.device) -> None:
    """Let a preference task see the built model before the techniques wrap it, as a training run's setup does: the
    frozen copy of `--reference copy` is made of it, and put on `device` (a run loads its model there first; the
    traced step builds it on the host and moves it after LoRA, which the copy never sees)."""
    if not is_preference(task):
        return
    task.prepare_model(model, None)
    reference = getattr(task, "_copy", None)  # the task's frozen copy, None for any other reference
    stream = getattr(task.reference_cost, "stream", None)
    if stream is not None:  # host-copy: the copy stays in host memory, its units brought to `device`
        stream.streamer.device = device
    elif reference is not None:
        reference.to(device)

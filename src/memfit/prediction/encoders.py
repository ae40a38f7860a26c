"""Encoders (BERT, RoBERTa, ESM, ModernBERT) and task heads, as the estimator sees them.

Two things differ from a causal LM, and this module answers both for the estimator, the layer
probe and the traced step:

- **The blocks.** An encoder attends both ways: no causal mask, the padding mask alone, which
  SDPA takes as it is. Its blocks are post-norm (BERT, RoBERTa) or pre-norm (ESM, ModernBERT)
  LayerNorm blocks with a GELU MLP (ModernBERT: GeGLU from one fused projection, Q/K/V fused
  too). `encoder_architecture` reads their numbers; what a block keeps for backward is measured
  from the model's own code by `memfit.prediction.layer_probe`, built from the masked-LM class
  (`probe_model_class`: the blocks are the same whatever the head, and encoders have no causal-LM
  class), where the task code finds them.
- **The head**, decided by `--task` (memfit.tasks): a causal or masked LM ends in vocabulary-sized
  logits (the masked LM at every position, as `tasks.heads.masked_lm_loss_sum` computes them, after
  its dense + GELU + LayerNorm transform); token classification in num_labels logits a token;
  sequence classification and regression in num_labels logits a sample (pooler + classifier:
  a few kilobytes). `task_head` gives the head's shape; `head_logits_bytes` its peak bytes.

The traced method runs the task's own model class, loss and batches (`traced_task`), so it needs
nothing of this beyond the label space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.prediction.activations import Architecture, Precision, architecture_of, logits_bytes

ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "camembert", "esm", "modernbert", "distilbert", "electra", "deberta-v2",
})
"""Model types read as bidirectional encoders (DNABERT-2 and Nucleotide Transformer load as bert and esm)."""

VOCABULARY_HEADS = ("AutoModelForCausalLM", "AutoModelForMaskedLM")
"""Task model classes whose head is vocabulary-sized (the rest end in num_labels logits)."""

ESM_GELU_INTERMEDIATES = 3
"""ESM writes its GELU out as x * 0.5 * (1 + erf(x / sqrt 2)): the erf's input, x * 0.5 and 1 + erf are kept
beside the output (BERT's fused GELU keeps its input alone), and backward forms as many gradients."""

DEFAULT_NUM_LABELS = 2
"""The head's width when neither --num-labels nor --label-names says it (binary classification)."""


def is_encoder(hf_config: Any) -> bool:
    """Whether `hf_config` describes a bidirectional encoder (not a decoder, nor BERT built with is_decoder)."""
    return getattr(hf_config, "model_type", "") in ENCODER_MODEL_TYPES and not getattr(hf_config, "is_decoder", False)


def padded_micro_batches(hf_config: Any, batch_size: int) -> bool:
    """Whether an estimate takes `batch_size` rows as padded to the longest (`prediction.padding_mask`): an encoder's
    rows differ in length, and two or more of them are padded; one row never is."""
    return is_encoder(hf_config) and batch_size > 1


def probe_model_class(hf_config: Any) -> Any:
    """The transformers auto class whose blocks the layer probe measures (an encoder has no causal-LM class)."""
    import transformers

    return transformers.AutoModelForMaskedLM if is_encoder(hf_config) else transformers.AutoModelForCausalLM


def encoder_architecture(c: Any) -> Architecture:
    """The Architecture of an encoder config (BERT, RoBERTa, ESM, ModernBERT and their kin)."""
    hidden, heads = c.hidden_size, c.num_attention_heads
    modern = c.model_type == "modernbert"
    dropout = getattr(c, "hidden_dropout_prob", None)
    if dropout is None:  # ModernBERT names its dropouts per place
        dropout = max(float(getattr(c, name, 0.0) or 0.0) for name in ("mlp_dropout", "embedding_dropout"))
    attention_dropout = getattr(c, "attention_probs_dropout_prob", None)
    if attention_dropout is None:
        attention_dropout = getattr(c, "attention_dropout", 0.0)
    return Architecture(
        c.model_type, hidden, c.num_hidden_layers, heads, heads, getattr(c, "head_dim", None) or hidden // heads,
        getattr(c, "intermediate_size", None) or 4 * hidden, c.vocab_size, gated_mlp=modern, rms_norm=False,
        gelu_intermediates=ESM_GELU_INTERMEDIATES if c.model_type == "esm" else 1, dropout=float(dropout or 0.0), attention_dropout=float(attention_dropout or 0.0),
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        learned_positions=getattr(c, "position_embedding_type", "absolute") == "absolute" and not modern,
        fused_qkv=modern,
    )


def backward_working_bytes(arch: Architecture, precision: Precision, tokens: int, tiles: int,
                           adapter_working: float) -> float:
    """What a block's MLP backward holds beyond the saved tensors counted elsewhere, for `tokens` tokens run over
    `tiles` tiles (--tiled-mlp: one tile's tokens at a time); `adapter_working` is what the decoders' LoRA terms
    count there (a gated MLP's two activation gradients under checkpointing, memfit's adapter slice).

    ESM's written-out GELU (ESM_GELU_INTERMEDIATES beyond a fused GELU's one) has its extra intermediates'
    gradients live in the MLP's backward, about 1.5 times their bytes (tracked on CPU, fp32, hidden 128 and 256,
    intermediate 4 x hidden: 43-52 bytes per token and hidden unit that the decoders' terms missed, with and
    without checkpointing), added to the decoders' terms.

    Under LoRA a plain (GELU) encoder MLP's backward is counted in place of the decoders' adapter terms, which
    describe a gated MLP (tracked on CPU, fp32, the 3-block test encoders at 1,024 tokens, intermediate 256 and
    512): with BERT's fused GELU the down projection's two input gradients (its adapter's and its frozen base's)
    are live beside the GELU's kept input and output, 2 intermediate-wide tensors; ESM's erf backward holds 7
    (the two products' gradients, its temporaries) where the GELU output, x * 0.5 and 1 + erf were kept: 4 more.
    The adapters' slice is no copy in fp32 (the cast is a no-op) but the first of the input gradients. Under
    --tiled-mlp the tile's backward (`activations.tiled_mlp_backward_bytes`) counts half the tile's MLP bytes as
    gradients already: the rest comes on top.
    """
    tiles = max(1, tiles)
    extra = arch.gelu_intermediates - 1 if arch.model_type == "esm" else 0
    width = precision.compute * arch.intermediate * tokens / tiles  # one intermediate-wide tensor of a tile
    if not precision.lora_rank or arch.gated_mlp or not is_encoder_architecture(arch):
        return adapter_working + 1.5 * extra * width
    held = 2 + extra
    if tiles > 1:
        held -= 0.5 * (1 + arch.gelu_intermediates)
    return max(0.0, held) * width


def is_encoder_architecture(arch: Architecture) -> bool:
    """Whether `arch` was read from an encoder's config (`encoder_architecture`)."""
    return arch.model_type in ENCODER_MODEL_TYPES


def trailing_embedding_gradient_bytes(head: TaskHead, arch: Architecture, trainable_shapes: list,
                                      trainable_bytes: int, lora_r: int) -> float:
    """The input embedding's gradient: backward makes it after every block's, so none of them is live beside it.

    The estimator spreads the model's gradients over its blocks to find what is live while a block's backward runs;
    counting a vocabulary-sized embedding there put its gradient beside the first block's recomputed activations,
    which it never is (ModernBERT, vocabulary 4,096, hidden 128, sequence classification under full checkpointing:
    +11.2 % over the tracked peak, +0.6 % without it). A head tied to the embedding is the estimator's `head` term
    already (its gradient comes first and the embedding's is added into it); LoRA freezes the embedding.
    """
    if lora_r or head.tied or (arch.vocab, arch.hidden) not in [tuple(shape) for shape in trainable_shapes]:
        return 0.0
    return float(arch.vocab * arch.hidden * trainable_bytes)


def architecture_for(hf_config: Any) -> Architecture:
    """The encoder's Architecture for an encoder, the decoder's otherwise (activations.architecture_of)."""
    return encoder_architecture(hf_config) if is_encoder(hf_config) else architecture_of(hf_config)


# ---------------------------------------------------------------------------
# Task heads
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskHead:
    """The shape of a task's output head."""

    outputs: int
    """Logits a position: the vocabulary (LM tasks) or the labels."""
    per_token: bool
    """Logits at every position (LM and token tasks), or one row a sample (sequence tasks)."""
    shifted: bool
    """Causal LM: the last position predicts nothing (s - 1 positions a sample)."""
    tied: bool
    """The head's weight is the input embedding's (its gradient is summed with the embedding's)."""
    vocabulary: bool
    """A vocabulary head: the loss may be chunked, and a masked LM runs its transform first."""
    transform: bool = False
    """A dense + GELU + LayerNorm transform before the vocabulary projection (masked-LM heads)."""

    def positions(self, batch_size: int, seq_len: int) -> int:
        """Rows of logits a micro-batch makes."""
        if not self.per_token:
            return batch_size
        return batch_size * (seq_len - 1 if self.shifted else seq_len)


def _task_class(config: Any):
    from memfit.tasks import TASK_CLASSES

    return TASK_CLASSES[config.task.task]


def num_labels_of(config: Any) -> int:
    """The head's width as an estimate sees it: --num-labels, else the --label-names, else the label columns of a
    regression or multi-label run, else DEFAULT_NUM_LABELS (the training data, which sizes the real head, is not read)."""
    task = config.task
    if task.num_labels:
        return task.num_labels
    names = [name for name in (task.label_names or "").split(",") if name.strip()]
    if names:
        return len(names)
    fields = [name for name in (task.label_fields or "").split(",") if name.strip()]
    if task.task == "regression" or (task.task == "sequence-classification" and task.problem_type == "multi-label"):
        return max(1, len(fields))
    if task.task == "sequence-classification" and task.problem_type == "auto" and len(fields) > 1:
        return len(fields)  # several label columns: multi-label, one logit each
    return DEFAULT_NUM_LABELS


def task_head(config: Any, arch: Architecture) -> TaskHead:
    """The head `config.task` puts on a model of `arch`."""
    task_class = _task_class(config)
    if task_class.auto_class == "AutoModelForCausalLM":
        return TaskHead(arch.vocab, True, True, arch.tied_embeddings, True)
    if task_class.auto_class == "AutoModelForMaskedLM":
        # BERT, ESM and ModernBERT tie the projection to the embedding unless their config says otherwise
        return TaskHead(arch.vocab, True, False, arch.tied_embeddings, True, transform=True)
    return TaskHead(num_labels_of(config), not task_class.sequence_level, False, False, False)


def vocabulary_head(config: Any) -> bool:
    """Whether the task's head makes vocabulary-sized logits (the only ones a loss chunk applies to)."""
    return _task_class(config).auto_class in VOCABULARY_HEADS


def head_logits_bytes(head: TaskHead, arch: Architecture, batch_size: int, seq_len: int, chunk_tokens: int,
                      compute_bytes: int, fused: bool) -> float:
    """Peak bytes of the head and its loss beyond the blocks' output, at the end of forward.

    Vocabulary heads follow `activations.logits_bytes` (chunked or not) over their positions; a masked LM's
    transform adds what its dense, GELU and LayerNorm keep for every position (the GELU's input, the LayerNorm's
    input and the projection's input, its fp32 mean and 1/std). A label head's logits are tiny: the same
    12 bytes a position and label as a vocabulary head's.
    """
    tokens = head.positions(batch_size, seq_len)
    if not head.vocabulary:
        return 12.0 * tokens * head.outputs
    sized = arch if head.outputs == arch.vocab else _with_vocab(arch, head.outputs)
    logits = logits_bytes(sized, tokens, chunk_tokens, compute_bytes, fused=fused and not head.transform)
    if head.transform:
        logits += (3 * compute_bytes * arch.hidden + 8) * tokens
    return logits


def _with_vocab(arch: Architecture, vocab: int) -> Architecture:
    from dataclasses import replace

    return replace(arch, vocab=vocab)


# ---------------------------------------------------------------------------
# The traced step's task
# ---------------------------------------------------------------------------


def traced_task(config: Any, hf_config: Any) -> tuple[Any, dict[str, Any], Any]:
    """(task, head settings for the model config, sample maker) for tracing `config`'s step without its data.

    The task is the one `memfit train` would build (memfit.tasks), its label space `num_labels_of(config)`
    labels; `make_sample(input_ids)` gives one sample as the task's data loader does: a class id, a vector of
    0/1 labels or of numbers a sample, a label a token, or a masked LM's targets (every position labelled: the
    loss and its logits cover every position whatever is masked).

    An encoder's rows differ in length and each micro-batch is padded to its longest: of every --batch-size
    samples made, the first keeps its `input_ids` and the others are cut to half of them. The batch keeps
    --seq-len positions, and with them every activation; on real tensors (the measured step) it also carries the
    attention masks a padded batch builds. On fake tensors every mask reads as all ones and is dropped, so the
    traced estimate adds them as the analytical one does (`prediction.padding_mask`).

    A preference task's sample is a pair of two such rows (`prediction.preference_step.traced_sample_maker`).
    """
    import torch

    from memfit.data.tables import LabelSpec
    from memfit.prediction.preference_step import is_preference, traced_sample_maker

    task = _task_class(config)(config)
    if is_preference(task):  # a sample is a pair: two rows of --seq-len tokens
        return task, task.model_config(), traced_sample_maker(task)
    labels = num_labels_of(config)
    if task.label_kind not in (None, "none"):
        task.spec = LabelSpec(task.label_kind, [], [f"label_{i}" for i in range(labels)])
    head_config = task.model_config()
    kind = task.label_kind
    rows = config.training.batch_size
    padded = padded_micro_batches(hf_config, rows)
    made = [0]

    def make_sample(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        if padded and made[0] % rows:  # not the first row of its micro-batch: a shorter row, padded
            input_ids = input_ids[: max(1, input_ids.numel() // 2)]
        made[0] += 1
        if kind == "class":
            target = torch.tensor(0)
        elif kind in ("multi-label", "number"):
            target = torch.zeros(labels, dtype=torch.float32)
        elif kind == "tokens":
            target = input_ids.remainder(labels)
        else:  # causal or masked LM: the tokens themselves
            target = input_ids.clone()
        return {"input_ids": input_ids, "labels": target}

    return task, head_config, make_sample

"""Fine-tuning samples: records -> (tokens, loss mask) once, cached; the length policy applied on load.

The cache holds, per (tokenizer, source content, format, field names, template, --train-on), one
directory:

    <cache_dir>/sft-<key>/tokens.bin    every sample's tokens back to back (uint16 or uint32)
    <cache_dir>/sft-<key>/mask.bin      uint8 per token: 1 where the token carries loss
    <cache_dir>/sft-<key>/offsets.npy   int64 start of each sample, plus the end
    <cache_dir>/sft-<key>/targets.npy   int64 tokens that carry loss per sample (the first never does)
    <cache_dir>/sft-<key>/index.json    what was built, with what, and the counts (written last)

Samples are stored whole; `--seq-len` and `--truncate` only choose which to keep (or where to cut)
when the cache is opened, so a new length never tokenizes again. As with `cache.py`, fresh data
is checked before it is renamed into place, and data a run cannot use leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.cache import default_cache_dir, token_dtype, tokenizer_fingerprint, vocab_size
from memfit.data.formats import FieldNames, detect_format, to_example
from memfit.data.lengths import LengthPolicy, check_length_loss, say_length, start_policy
from memfit.data.masks import build_sample
from memfit.data.packing import resolve_packing
from memfit.data.records import first_record, iter_records
from memfit.data.sources import TextSource
from memfit.data.templates import ChatRenderer, resolve_chat_template, template_fingerprint
from memfit.data.windows import IGNORE_INDEX
from memfit.errors import UsageError

logger = logging.getLogger(__name__)

BUILTIN_TOKENIZER_TEMPLATE = "chatml"
"""Template for conversations on memfit's byte tokenizer, which has none of its own."""
BYTE_TOKENIZER_FINGERPRINT = "memfit-byte-v1"
SFT_CACHE_FORMAT = 1  # bump when the layout or the rules that build samples change


@dataclass
class SampleStore:
    """Every sample of a source, whole: tokens, loss mask, where each sample starts, its target count."""

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray
    index: dict[str, Any]
    from_cache: bool = True

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1


def resolve_format(source: TextSource, requested: str, fields: FieldNames) -> str:
    """The format of `source`: `requested` unless `auto`; text files are text."""
    if source.kind == "txt":
        if requested not in ("auto", "text"):
            raise UsageError(f"--dataset-format {requested} needs records: give a .jsonl, .parquet or hf: dataset")
        return "text"
    if requested != "auto":
        return requested
    record = first_record(source)
    if record is None:
        raise UsageError(f"{source.label} holds no records; give a dataset with at least one")
    return detect_format(record, fields, source.label)


def apply_length_policy(store: SampleStore, seq_len: int | None, truncate: bool,
                        max_positions: int | None = None) -> LengthPolicy:
    """Keep the samples that fit `seq_len` (or cut the longer ones with `truncate`), and count what it cost.

    `seq_len` None: the length comes from the data (memfit.data.lengths.seq_len_from_data), within `max_positions`.
    """
    lengths = np.diff(store.offsets)
    targets = store.targets.astype(np.int64).copy()
    policy = start_policy(lengths, targets, seq_len, truncate, max_positions)
    seq_len = policy.seq_len
    long = lengths > seq_len
    kept_lengths = np.minimum(lengths, seq_len)
    if truncate:
        for sample in np.flatnonzero(long):
            start = int(store.offsets[sample])
            left = int(store.mask[start + 1 : start + seq_len].sum())  # the first token is never a target
            policy.target_tokens_lost += int(targets[sample]) - left
            targets[sample] = left
        policy.truncated = int(long.sum())
        keep = targets > 0
        policy.dropped_no_target = int((targets == 0).sum())
    else:
        policy.dropped_long = int(long.sum())
        policy.target_tokens_lost += int(targets[long].sum())
        keep = ~long & (targets > 0)
        policy.dropped_no_target = int((~long & (targets == 0)).sum())
    policy.kept = np.flatnonzero(keep).astype(np.int64)
    policy.lengths = kept_lengths[keep].astype(np.int64)
    policy.targets = targets[keep]
    return policy


class SFTDataset(torch.utils.data.Dataset):
    """Fine-tuning samples: `dataset[i]` is {"input_ids", "labels"}, 1-D LongTensors (labels -100 where no loss).

    One sample per conversation or prompt-completion record, cut or dropped by the length policy.
    `lengths[i]` is sample i's token count (what packing and the planner read).
    """

    def __init__(self, store: SampleStore, policy: LengthPolicy, fmt: str, source: str, template_name: str | None) -> None:
        self.store = store
        self.policy = policy
        self.format = fmt
        self.source = source
        self.template_name = template_name
        self.seq_len = policy.seq_len
        self.stride = 0
        self.lengths = policy.lengths
        self.packing = "off"  # one sample per row until a packer lays samples out
        self.supervised = True

    def __len__(self) -> int:
        return len(self.policy.kept)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        index = int(index) % len(self)
        start = int(self.store.offsets[int(self.policy.kept[index])])
        stop = start + int(self.policy.lengths[index])
        input_ids = torch.from_numpy(np.asarray(self.store.tokens[start:stop], dtype=np.int64))
        mask = torch.from_numpy(np.asarray(self.store.mask[start:stop], dtype=np.bool_))
        labels = torch.where(mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        return {"input_ids": input_ids, "labels": labels}

    @property
    def num_tokens(self) -> int:
        """Tokens in the kept samples (after cutting)."""
        return int(self.policy.lengths.sum())

    @property
    def num_documents(self) -> int:
        """Records in the source (kept or not)."""
        return self.store.num_samples

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry a loss over one pass of every kept sample."""
        return int(self.policy.targets.sum())

    @property
    def from_cache(self) -> bool:
        return self.store.from_cache

    def data_facts(self) -> dict[str, Any]:
        """What the data is and what the length policy cost (metrics and report)."""
        return {"format": self.format, "chat_template": self.template_name, "records": self.num_documents,
                "tokens": self.num_tokens, "target_tokens": self.num_target_tokens,
                "train_on": self.store.index.get("train_on"), **self.policy.facts()}

    @property
    def description(self) -> str:
        """One line for the user: source, format, samples, target share, what the length policy cost."""
        p = self.policy
        share = self.num_target_tokens / max(1, self.num_tokens)
        origin = "from cache" if self.from_cache else "tokenized now, cached"
        template = f", template {self.template_name}" if self.template_name else ""
        # What the length dropped or cut has lines of its own (memfit.data.lengths.length_lines), not a clause here.
        kept = f"{len(self):,} of {p.samples:,} samples" if len(self) != p.samples else f"{len(self):,} samples"
        return (f"{self.source}: {self.num_documents:,} records ({self.format}{template}, loss on"
                f" {self.store.index.get('train_on')}), {kept} of <= {self.seq_len} tokens,"
                f" {self.num_tokens:,} tokens, {share:.0%} carry loss, {origin}")


def load_sft_data(
    data_cfg: Any, tokenizer: Any, source: TextSource, fmt: str, *, min_samples: int = 1,
    max_positions: int | None = None, say: bool = True,
) -> SFTDataset:
    """Samples of a conversational or prompt-completion source, built once and cached; the length
    policy applied (--seq-len, or the length from the data when it is None, within `max_positions`).
    Raises UsageError for bad records, a missing template, a length that drops more than 1% of the samples
    or target tokens (without --allow-drop), or too few samples left. `say`: log what the length did."""
    fields = field_names(data_cfg)
    template = template_name = choice = None
    if fmt != "prompt-completion" or _conversational_prompts(source, fields):
        choice = data_cfg.chat_template
        if not choice and not getattr(tokenizer, "chat_template", None) and _is_builtin_byte_tokenizer(tokenizer):
            choice = BUILTIN_TOKENIZER_TEMPLATE
        template = resolve_chat_template(tokenizer, choice, getattr(tokenizer, "name_or_path", "") or "the model")
        template_name = choice or "the tokenizer's"
        if choice:
            # Saved with the final model's tokenizer, so inference renders conversations the same way.
            tokenizer.chat_template = template
    parts = {
        "format": SFT_CACHE_FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer), "source": source.identity(),
        "dataset_format": fmt, "fields": fields.identity(), "template": template_fingerprint(template or ""),
        "train_on": data_cfg.train_on,
    }
    key = "sft-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    root = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()
    datasets: list[SFTDataset] = []

    def check(store: SampleStore) -> None:
        policy = apply_length_policy(store, data_cfg.seq_len, data_cfg.truncate, max_positions)
        if len(policy.kept) == 0:
            raise UsageError(empty_message(source.label, store, policy))
        check_length_loss(policy, source.label, data_cfg.allow_drop)  # before anything is written
        if len(policy.kept) < min_samples:
            raise UsageError(
                f"{source.label} has {len(policy.kept)} samples that fit --seq-len {policy.seq_len}, fewer than one"
                f" effective batch ({min_samples}); lower --batch-size/--gradient-accumulation-steps or add data"
            )
        datasets.append(SFTDataset(store, policy, fmt, source.label, template_name))

    final = root / key
    if (final / "index.json").is_file():
        check(open_samples(final))
    else:
        renderer = ChatRenderer(tokenizer, template) if template else None
        build_and_publish(root, key, lambda directory: write_samples(
            directory, source, fmt, fields, renderer, tokenizer, data_cfg.train_on, parts), check)
        datasets[-1].store.from_cache = False
    if choice and not data_cfg.chat_template and say:  # said once the data is good: bad input stays one line
        logger.warning("memfit: chat template: the built-in byte tokenizer has none; conversations are rendered"
                       " with memfit's %s (--chat-template %s)", choice, choice)
    if say:
        say_length(datasets[-1].policy, source.label, data_cfg.allow_drop, logger)
    return datasets[-1]


def empty_message(label: str, store: SampleStore, policy: LengthPolicy) -> str:
    if policy.dropped_long:
        keep = policy.seq_len_keeping_all
        raise_it = f"pass --seq-len {keep} or --truncate" if keep else "raise --seq-len or pass --truncate"
        return (f"no sample of {label} is left: {policy.dropped_long} of {store.num_samples} are longer than --seq-len"
                f" {policy.seq_len} (the longest has {policy.longest} tokens); {raise_it}")
    return (f"no sample of {label} has a token to train on after cutting to --seq-len {policy.seq_len};"
            " raise --seq-len, or drop --truncate so long samples are skipped instead")


def _is_builtin_byte_tokenizer(tokenizer: Any) -> bool:
    """memfit's own byte tokenizer (the `tiny` model's, and presets'), which ships no chat template."""
    return getattr(tokenizer, "fingerprint", None) == BYTE_TOKENIZER_FINGERPRINT


def field_names(data_cfg: Any) -> FieldNames:
    return FieldNames(text=data_cfg.text_field, messages=data_cfg.messages_field, prompt=data_cfg.prompt_field,
                      completion=data_cfg.completion_field)


def _conversational_prompts(source: TextSource, fields: FieldNames) -> bool:
    record = first_record(source)
    return isinstance(record, dict) and isinstance(record.get(fields.prompt), list)


def write_samples(directory: Path, source: TextSource, fmt: str, fields: FieldNames, renderer: ChatRenderer | None,
                  tokenizer: Any, train_on: str, parts: dict) -> None:
    dtype = token_dtype(vocab_size(tokenizer))
    limit = np.iinfo(dtype).max
    offsets, targets = [0], []
    with (directory / "tokens.bin").open("wb") as tokens_file, (directory / "mask.bin").open("wb") as mask_file:
        for number, record in enumerate(iter_records(source), start=1):
            example = to_example(record, fmt, number, fields, source.label)
            try:
                ids, mask = build_sample(renderer, tokenizer, example, train_on)
            except UsageError as error:
                raise type(error)(f"{source.label} record {number}: {error}") from None
            if not ids:
                continue
            array = np.asarray(ids, dtype=np.int64)
            if array.max() > limit or array.min() < 0:
                raise UsageError(f"the tokenizer produced id {int(array.max())}, outside its vocabulary; check the tokenizer")
            array.astype(dtype).tofile(tokens_file)
            flags = np.asarray(mask, dtype=np.uint8)
            flags.tofile(mask_file)
            offsets.append(offsets[-1] + len(array))
            targets.append(int(flags[1:].sum()))
    if not targets:
        raise UsageError(f"{source.label} holds no records; give a dataset with at least one")
    np.save(directory / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(directory / "targets.npy", np.asarray(targets, dtype=np.int64))
    index = {"source": source.label, "key_parts": parts, "dtype": dtype.name, "num_tokens": offsets[-1],
             "num_samples": len(targets), "train_on": train_on, "dataset_format": fmt}
    (directory / "index.json").write_text(json.dumps(index, indent=1))  # last: a directory without it is never read


def open_samples(directory: Path) -> SampleStore:
    index = json.loads((directory / "index.json").read_text())
    count = index["num_tokens"]
    tokens = np.memmap(directory / "tokens.bin", dtype=np.dtype(index["dtype"]), mode="r", shape=(count,))
    mask = np.memmap(directory / "mask.bin", dtype=np.uint8, mode="r", shape=(count,))
    return SampleStore(tokens, mask, np.load(directory / "offsets.npy"), np.load(directory / "targets.npy"), index)


def build_and_publish(root: Path, key: str, write, check) -> None:
    """Write into a temporary directory, check, rename into place; on any failure leave nothing behind."""
    created = []
    directory = root
    while not directory.exists() and directory != directory.parent:
        created.append(directory)
        directory = directory.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    except OSError as error:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise UsageError(f"cannot write the token cache in {root} ({error.strerror}); pass --cache-dir DIR") from None
    published = False
    try:
        write(tmp)
        check(open_samples(tmp))
        try:
            os.rename(tmp, root / key)
        except OSError:
            if not (root / key / "index.json").is_file():  # else another process finished the same cache first
                raise
        published = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not published:
            if created:  # the outermost directory made here takes the rest with it
                shutil.rmtree(created[-1], ignore_errors=True)
    store = open_samples(root / key)
    check(store)  # the dataset points at the published copy, not the removed temporary one



def plain_text(data_cfg: Any) -> bool:
    """Whether `data_cfg.dataset` is plain text (windows of --seq-len), not whole samples; reads one record at most."""
    from memfit.data.records import resolve

    source = resolve(data_cfg.dataset, data_cfg.text_field)
    return resolve_format(source, data_cfg.dataset_format, field_names(data_cfg)) == "text"


def load_supervised_data(data_cfg: Any, tokenizer: Any, *, min_samples: int = 1, max_positions: int | None = None,
                         say: bool = True) -> SFTDataset | None:
    """The fine-tuning samples of `data_cfg.dataset`, or None when it is plain text (the windows path reads it)."""
    from memfit.data.records import resolve

    source = resolve(data_cfg.dataset, data_cfg.text_field)
    fmt = resolve_format(source, data_cfg.dataset_format, field_names(data_cfg))
    if fmt == "text":
        return None
    resolve_packing(data_cfg.packing, supervised=True)  # whole samples only: --packing wrapped refused before any write
    return load_sft_data(data_cfg, tokenizer, source, fmt, min_samples=min_samples, max_positions=max_positions, say=say)


def dataset_facts(dataset: Any) -> dict[str, Any] | None:
    """What the metrics record about fine-tuning data (format, template, length policy); None for plain text."""
    facts = getattr(dataset, "data_facts", None)
    return facts() if callable(facts) else None


def describe_facts(facts: dict[str, Any]) -> str:
    """`dataset_facts` in words (the HTML report's data row)."""
    template = f", template {facts['chat_template']}" if facts.get("chat_template") else ""
    text = (f"{facts.get('format')}{template}, loss on {facts.get('train_on')}: {facts.get('samples_kept', 0):,} samples,"
            f" {facts.get('target_tokens', 0):,} of {facts.get('tokens', 0):,} tokens carry loss")
    cost = []
    if facts.get("samples_dropped_long"):
        cost.append(f"{facts['samples_dropped_long']:,} longer than {facts.get('seq_len')} tokens dropped")
    if facts.get("samples_truncated"):
        cost.append(f"{facts['samples_truncated']:,} cut to {facts.get('seq_len')} tokens")
    if facts.get("samples_dropped_no_target"):
        cost.append(f"{facts['samples_dropped_no_target']:,} without a target token dropped")
    if cost:
        text += "; " + ", ".join(cost) + f" ({facts.get('target_tokens_lost', 0):,} target tokens lost)"
    if facts.get("seq_len_from_data"):
        text += f"; --seq-len {facts.get('seq_len')} from the data"
    return text

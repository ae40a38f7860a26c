"""`memfit data DATASET --model M`: the data as the model will see it, before any training.

Prints the first samples rendered with the tokens that carry loss marked, then the length
distribution, the share of tokens that carry loss, what the length policy drops or cuts (a line of its
own, with the --seq-len that keeps every sample), and the packing efficiency at --seq-len (without
--seq-len: the length `memfit train` would take from the data). `--json` gives the same as one object, with each shown sample's
input_ids, labels (-100 where masked) and position_ids. Tokenizes into a temporary directory
(or --cache-dir): nothing is left behind.

With a preference task (--task dpo, simpo, orpo, kto) the data is preference pairs or labelled completions
(memfit.data.preferences): each shown item is its prompt and its completions decoded from their tokens, the
completions (the scored tokens) marked, then the lengths of each part, the pair-length distribution and what
--seq-len keeps, cuts and drops. With --task grpo the data is prompts (memfit.data.prompts): each shown prompt as
generation reads it, the columns the reward functions receive, and the prompt lengths.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError

SUMMARY = (
    "Show a dataset as the model sees it: the first samples rendered through the chat template with the\n"
    "tokens that carry loss marked, the length distribution (p50/p90/p99/max), the share of tokens with\n"
    "loss, the samples --seq-len drops or cuts, and the packing efficiency."
)
MARK_OPEN, MARK_CLOSE = "[[", "]]"
COLOR_OPEN, COLOR_CLOSE = "\033[1;32m", "\033[0m"


@dataclass
class DataOptions:
    show: int = 3
    """Samples to print rendered."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""


HELP = CommandHelp(
    "data", "memfit data DATASET [--model MODEL] [--FLAG VALUE ...]", SUMMARY, (DataOptions,),
    first=("config", "model", "seq_len", "dataset_format", "chat_template", "train_on", "packing", "truncate"),
    arguments=(("DATASET", "The data, as --dataset takes it: a .txt, .jsonl or .parquet file, hf:NAME, builtin:chat;"
                           " with --task dpo|simpo|orpo|kto, preference pairs such as builtin:preferences;"
                           " with --task grpo, prompts such as builtin:prompts."),),
    first_title="the training flags it reads most (it takes every memfit train flag):",
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    if argv and not argv[0].startswith("--"):
        argv = ["--dataset", argv[0], *argv[1:]]
    config, extras = parse_command_line(argv, [DataOptions])
    from memfit.models.model_names import check_model_flags

    check_model_flags(config)  # no such model: one line, before anything is read
    options: DataOptions = extras[DataOptions]
    if options.show < 0:
        raise UsageError(f"--show must be 0 or more, got {options.show}")
    from memfit.cli.output import print_json, stdout_to_stderr

    with stdout_to_stderr(options.json):
        report = inspect_dataset(config, options.show)
    if options.json:
        print_json(report)
        return 0
    print(render(report, color=sys.stdout.isatty()))
    return 0


def inspect_dataset(config: Any, show: int) -> dict[str, Any]:
    """What `memfit data` prints, as a dict (the --json object)."""
    import numpy as np

    from memfit.data.preferences import PREFERENCE_TASKS

    if config.task.task in PREFERENCE_TASKS:
        return inspect_preference_dataset(config, show)
    if config.task.task == "grpo":
        return inspect_prompt_dataset(config, show)

    from memfit.data import load_training_data
    from memfit.data.packing import packing_efficiency
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="memfit-data-") as scratch:
        # Shown, never refused: what a drop costs is this command's answer (train refuses over 1%).
        data_cfg = dataclasses.replace(config.data, cache_dir=config.data.cache_dir or scratch, allow_drop=True)
        dataset = load_training_data(data_cfg, tokenizer, max_positions=_model_positions(config), say=False)
        seq_len = dataset.seq_len  # without --seq-len: what the data chose
        supervised = getattr(dataset, "supervised", False)
        if supervised:
            all_lengths = np.diff(np.asarray(dataset.store.offsets))
            policy = dataset.policy.facts()
            if dataset.policy.from_data is not None:
                policy["seq_len_choice"] = dataset.policy.from_data.describe()
        else:
            all_lengths = np.asarray(dataset.lengths)
            policy = {}
        kept = np.asarray(dataset.lengths, dtype=np.int64)
        samples = [_sample(dataset[i], tokenizer, config.distributed.context_parallel)
                   for i in range(min(show, len(dataset)))]
        report = {
            "dataset": getattr(dataset, "source", config.data.dataset),
            "format": getattr(dataset, "format", "text"),
            "chat_template": getattr(dataset, "template_name", None),
            "train_on": config.data.train_on if supervised else "all",
            "seq_len": seq_len,
            "records": int(dataset.num_documents),
            "samples": len(dataset),
            "lengths": {
                "count": len(all_lengths), "mean": round(float(all_lengths.mean()), 1),
                **{f"p{q}": int(np.percentile(all_lengths, q, method="higher")) for q in (50, 90, 99)},
                "max": int(all_lengths.max()),
            },
            "tokens": int(kept.sum()),
            "target_tokens": int(dataset.num_target_tokens),
            "loss_token_share": round(int(dataset.num_target_tokens) / max(1, int(kept.sum())), 4),
            "length_policy": policy,
            "packing_efficiency": round(packing_efficiency(kept, seq_len), 4),
            "padded_efficiency": round(float(kept.sum()) / (len(kept) * seq_len), 4),
            "shown": samples,
        }
    return report


def inspect_preference_dataset(config: Any, show: int) -> dict[str, Any]:
    """`inspect_dataset` of preference data: memfit.data.preference_view.preference_report (the --json object)."""
    from memfit.data.preference_view import preference_report
    from memfit.data.preferences import load_preference_data
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    # Shown, never refused: what a drop costs is this command's answer (train refuses over 1%).
    data_cfg = dataclasses.replace(config.data, allow_drop=True)
    dataset = load_preference_data(data_cfg, tokenizer, task=config.task.task, max_positions=_model_positions(config),
                                   say=False)
    return preference_report(dataset, tokenizer, show)


def inspect_prompt_dataset(config: Any, show: int) -> dict[str, Any]:
    """`inspect_dataset` of --task grpo's prompts: memfit.data.prompts.prompt_report (the --json object)."""
    from memfit.data.prompts import load_prompts, prompt_report
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    limit = config.rl.max_prompt_length
    items = load_prompts(config.data, tokenizer, max_prompt_length=limit, say=False)
    label = config.data.dataset or "the data"
    return prompt_report(items, tokenizer, dataset=label, max_prompt_length=limit, show=show)


def _model_positions(config: Any) -> int | None:
    """The positions of --model (scaled by --rope-scale), which cap a length from the data; None when unknown."""
    from memfit.errors import MemfitError
    from memfit.models.presets import resolve_model_config
    from memfit.models.rope import scaled_positions

    try:
        return scaled_positions(resolve_model_config(config.model.model, config.model.trust_remote_code),
                                config.model.rope_scale, config.model.rope_scaling)
    except (MemfitError, OSError, ValueError):  # the data is still worth showing
        return None


def length_policy_lines(report: dict[str, Any]) -> list[str]:
    """What the length does to the samples, one line each: the length from the data, the drop (or the cuts of
    --truncate) with the target tokens it costs, and the --seq-len that keeps every sample."""
    from memfit.data.lengths import LOSS_LIMIT_PERCENT

    policy, seq_len = report["length_policy"], report["seq_len"]
    lines = [policy["seq_len_choice"]] if policy.get("seq_len_choice") else []
    samples, targets = policy["samples_before"], policy["target_tokens_before"]
    lost = f"{policy['target_tokens_lost']:,} of {targets:,} target tokens ({100 * policy['target_tokens_lost'] / max(1, targets):.1f}%)"
    if policy.get("truncate") and policy["samples_truncated"]:
        lines.append(f"cut: {policy['samples_truncated']:,} of {samples:,} samples cut to their first {seq_len} tokens"
                     f" (--truncate), {lost} cut off")
    elif policy["samples_dropped_long"]:
        share = 100 * policy["samples_dropped_long"] / max(1, samples)
        over = share > LOSS_LIMIT_PERCENT or policy["target_tokens_lost"] * 100 > LOSS_LIMIT_PERCENT * targets
        lines.append(f"DROPPED: {policy['samples_dropped_long']:,} of {samples:,} samples ({share:.1f}%) are longer than"
                     f" --seq-len {seq_len} and would be dropped, {lost} lost"
                     + ("; memfit train stops on this without --allow-drop or --truncate" if over else ""))
    elif not policy.get("seq_len_choice"):  # a length from the data says what it keeps
        lines.append(f"at --seq-len {seq_len}: every sample fits (the longest has {policy['longest_sample']:,} tokens)")
    if policy["samples_dropped_no_target"]:
        lines.append(f"{policy['samples_dropped_no_target']:,} samples dropped with nothing left to train on")
    keep = policy.get("seq_len_keeping_all")
    if keep and keep != seq_len and (policy["samples_dropped_long"] or policy["samples_truncated"]):
        lines.append(f"suggested: --seq-len {keep} keeps every sample whole (the longest has {policy['longest_sample']:,}"
                     " tokens)")
    return lines


def _sample(sample: dict, tokenizer: Any, context_parallel: int = 1) -> dict[str, Any]:
    from memfit.distributed.sequence_shards import shard_layout

    ids = sample["input_ids"].tolist()
    labels = sample["labels"].tolist()
    carries = [label != -100 for label in labels]
    carries[0] = False  # the loss shifts labels by one: the first token is never predicted
    runs: list[tuple[bool, str]] = []
    start = 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or carries[index] != carries[start]:
            runs.append((carries[start], tokenizer.decode(ids[start:index])))
            start = index
    return {
        "runs": runs,
        "input_ids": ids,
        "labels": [label if carry else -100 for label, carry in zip(labels, carries, strict=True)],
        "position_ids": list(range(len(ids))),
        "target_tokens": sum(carries),
        # --context-parallel N: each rank's contiguous shard of the row, split as training splits it
        **({"context_shards": shard_layout(sample["input_ids"], sample["labels"], context_parallel)}
           if context_parallel > 1 else {}),
    }


def context_shard_line(shards: list[dict[str, int]]) -> str:
    """One line: where --context-parallel N cuts the row, and what each rank scores."""
    cuts = "; ".join(f"rank {s['rank']}: tokens {s['first']}-{s['last']} (positions from {s['first_position']}),"
                     f" {s['targets']} targets" for s in shards)
    return (f"--context-parallel {len(shards)}: {cuts}; a shard's last token is scored against the next shard's"
            " first, so the targets add up to the row's")


def render(report: dict[str, Any], color: bool = False) -> str:
    if report.get("prompts"):
        from memfit.data.prompts import describe_prompt_data

        return describe_prompt_data(report)
    if report.get("preference"):
        from memfit.data.preference_view import describe_preference_data

        return describe_preference_data(report, color, (MARK_OPEN, MARK_CLOSE), (COLOR_OPEN, COLOR_CLOSE))
    opened, closed = (COLOR_OPEN, COLOR_CLOSE) if color else (MARK_OPEN, MARK_CLOSE)
    lines = [f"{report['dataset']}: {report['records']:,} records, format {report['format']}"
             + (f", chat template {report['chat_template']}" if report["chat_template"] else "")
             + f", loss on {report['train_on']}"]
    marked = "in green" if color else f"between {MARK_OPEN} and {MARK_CLOSE}"
    for number, sample in enumerate(report["shown"], start=1):
        lines += ["", f"--- sample {number}: {len(sample['input_ids'])} tokens, {sample['target_tokens']} carry loss"
                      f" (shown {marked}) ---"]
        lines.append("".join(f"{opened}{text}{closed}" if carry else text for carry, text in sample["runs"]))
        if sample.get("context_shards"):
            lines.append(context_shard_line(sample["context_shards"]))
    lengths = report["lengths"]
    lines += ["", f"sample lengths (tokens, {lengths['count']:,} samples): p50 {lengths['p50']:,}, p90 {lengths['p90']:,},"
                  f" p99 {lengths['p99']:,}, max {lengths['max']:,}, mean {lengths['mean']:,}"]
    lines.append(f"tokens that carry loss: {report['target_tokens']:,} of {report['tokens']:,}"
                 f" ({report['loss_token_share']:.1%}) in the {report['samples']:,} samples kept")
    if report["length_policy"]:
        lines += length_policy_lines(report)
    if report["format"] == "text":  # plain text is laid end to end and cut (--packing wrapped): no packing to weigh
        lines.append(f"plain text in {report['samples']:,} windows of <= {report['seq_len']} tokens:"
                     f" {report['padded_efficiency']:.1%} of positions hold a token")
    else:
        lines.append(f"packing efficiency at --seq-len {report['seq_len']}: {report['packing_efficiency']:.1%} of positions"
                     f" hold a token with --packing samples, {report['padded_efficiency']:.1%} padded to --seq-len one"
                     " sample a row")
    return "\n".join(lines)


def plan_from_dataset(config: Any) -> tuple[Any, dict[str, Any]]:
    """`memfit plan --dataset D`: the config with --seq-len taken from D's sample lengths, and what was chosen.

    Conversations and prompt-completion samples are never cut across windows, so the planned length is the one
    `memfit train` takes from the data (memfit.data.lengths.seq_len_from_data): the longest sample, or the length
    keeping 99% of the samples and target tokens when a few outliers are over 1.5x longer, rounded up to a multiple
    of 64 within the model's positions. Plain text is cut into windows of any length: --seq-len stays as given
    (256 when not given). A --seq-len the user gave is kept.
    """
    import numpy as np

    from memfit.config import DEFAULT_SEQ_LEN
    from memfit.data.lengths import seq_len_from_data

    lengths, targets, supervised = _sample_lengths(config)
    quantiles = {f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 99)}
    longest = int(lengths.max())
    facts: dict[str, Any] = {"samples": len(lengths), **quantiles, "max": longest}
    if not supervised or config.data.seq_len is not None:
        seq_len = config.data.seq_len or DEFAULT_SEQ_LEN
        facts["basis"] = "plain text, cut into windows of --seq-len" if not supervised else "--seq-len as given"
    else:
        choice = seq_len_from_data(lengths, targets, _model_positions(config))
        seq_len = choice.seq_len
        facts["basis"] = ("the longest sample" if choice.basis == choice.longest else
                          "the length keeping 99% of the samples and target tokens (a few outliers are far longer)")
        if choice.max_positions:
            facts["basis"] += f", capped at the model's {choice.max_positions:,} positions"
    seq_len = max(seq_len, 2)
    facts["seq_len"] = seq_len
    facts["samples_longer"] = int((lengths > seq_len).sum()) if supervised else 0
    return config.with_seq_len(seq_len), facts


def _task_sample_lengths(config: Any, data_cfg: Any, tokenizer: Any) -> tuple[Any, Any, bool] | None:
    """A preference task's pair lengths (the prompt and the longer answer; the answers' tokens as targets) or GRPO's
    prompt lengths (a row's prompt part: --max-completion-length is added to it), read as those tasks read their
    data; None for the tasks that read causal-LM samples."""
    import numpy as np

    from memfit.config_sections import PREFERENCE_TASKS

    task = config.task.task
    if task in PREFERENCE_TASKS:
        from memfit.data.preferences import load_preference_data

        segments = load_preference_data(data_cfg, tokenizer, task=task, say=False).segment_lengths
        return segments[:, 0] + segments[:, 1:].max(axis=1), segments[:, 1:].sum(axis=1), True
    if task == "grpo":
        from memfit.data.prompts import load_prompts

        items = load_prompts(data_cfg, tokenizer, max_prompt_length=config.rl.max_prompt_length, say=False)
        lengths = np.asarray([len(item.prompt_ids) for item in items], dtype=np.int64)
        return lengths, lengths, True
    return None


def describe_plan_basis(dataset: str, facts: dict[str, Any]) -> str:
    line = (f"planned at --seq-len {facts['seq_len']:,}: {facts['basis']} of {dataset} ({facts['samples']:,} samples;"
            f" p50 {facts['p50']:,}, p90 {facts['p90']:,}, p99 {facts['p99']:,}, max {facts['max']:,} tokens)")
    if facts["samples_longer"]:
        line += (f"; {facts['samples_longer']:,} longer samples would be dropped (--truncate cuts them; over 1% memfit"
                 " train stops without --allow-drop)")
    return line


def _sample_lengths(config: Any) -> tuple[Any, Any, bool]:
    """Token counts and target-token counts of every sample of config.data.dataset (whole, before any length
    policy), and whether it is a supervised format (plain text: its documents, every token a target). Tokenized
    into a temporary directory unless --cache-dir is given."""
    import numpy as np

    from memfit.data import load_training_data
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="memfit-data-") as scratch:
        # No length policy and one document a window: every sample is seen whole.
        data_cfg = dataclasses.replace(config.data, cache_dir=config.data.cache_dir or scratch, seq_len=1 << 30,
                                       stride=0, packing="off", truncate=False)
        task_lengths = _task_sample_lengths(config, data_cfg, tokenizer)
        if task_lengths is not None:
            return task_lengths
        dataset = load_training_data(data_cfg, tokenizer, say=False)
        if getattr(dataset, "supervised", False):
            return np.diff(np.asarray(dataset.store.offsets)), np.asarray(dataset.store.targets).copy(), True
        lengths = np.asarray(dataset.lengths, dtype=np.int64).copy()
        return lengths, lengths, False

"""`memfit data DATASET --model M`: the data as the model will see it, before any training.

Prints the first samples rendered with the tokens that carry loss marked, then the length
distribution, the share of tokens that carry loss, what the length policy drops or cuts, and the
packing efficiency at --seq-len. `--json` gives the same as one object, with each shown sample's
input_ids, labels (-100 where masked) and position_ids. Tokenizes into a temporary directory
(or --cache-dir): nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from memfit.cli.flags import help_text, parse_command_line
from memfit.errors import UsageError

SUMMARY = (
    "Show a dataset as the model sees it: the first samples rendered through the chat template with the\n"
    "tokens that carry loss marked, the length distribution (p50/p90/p99/max), the share of tokens with\n"
    "loss, the samples --seq-len drops or cuts, and the packing efficiency. Usage: memfit data DATASET --model M."
)
MARK_OPEN, MARK_CLOSE = "[[", "]]"
COLOR_OPEN, COLOR_CLOSE = "\033[1;32m", "\033[0m"


@dataclass
class DataOptions:
    show: int = 3
    """Samples to print rendered."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""


def run(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("data", SUMMARY, [DataOptions]))
        return 0
    if argv and not argv[0].startswith("--"):
        argv = ["--dataset", argv[0], *argv[1:]]
    config, extras = parse_command_line(argv, [DataOptions])
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

    from memfit.data import load_training_data
    from memfit.data.packing import packing_efficiency
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="memfit-data-") as scratch:
        data_cfg = dataclasses.replace(config.data, cache_dir=config.data.cache_dir or scratch)
        dataset = load_training_data(data_cfg, tokenizer)
        supervised = getattr(dataset, "supervised", False)
        if supervised:
            all_lengths = np.diff(np.asarray(dataset.store.offsets))
            policy = dataset.policy.facts()
        else:
            all_lengths = np.asarray(dataset.lengths)
            policy = {}
        kept = np.asarray(dataset.lengths, dtype=np.int64)
        samples = [_sample(dataset[i], tokenizer) for i in range(min(show, len(dataset)))]
        report = {
            "dataset": getattr(dataset, "source", config.data.dataset),
            "format": getattr(dataset, "format", "text"),
            "chat_template": getattr(dataset, "template_name", None),
            "train_on": config.data.train_on if supervised else "all",
            "seq_len": config.data.seq_len,
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
            "packing_efficiency": round(packing_efficiency(kept, config.data.seq_len), 4),
            "padded_efficiency": round(float(kept.sum()) / (len(kept) * config.data.seq_len), 4),
            "shown": samples,
        }
    return report


def _sample(sample: dict, tokenizer: Any) -> dict[str, Any]:
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
    }


def render(report: dict[str, Any], color: bool = False) -> str:
    opened, closed = (COLOR_OPEN, COLOR_CLOSE) if color else (MARK_OPEN, MARK_CLOSE)
    lines = [f"{report['dataset']}: {report['records']:,} records, format {report['format']}"
             + (f", chat template {report['chat_template']}" if report["chat_template"] else "")
             + f", loss on {report['train_on']}"]
    marked = "in green" if color else f"between {MARK_OPEN} and {MARK_CLOSE}"
    for number, sample in enumerate(report["shown"], start=1):
        lines += ["", f"--- sample {number}: {len(sample['input_ids'])} tokens, {sample['target_tokens']} carry loss"
                      f" (shown {marked}) ---"]
        lines.append("".join(f"{opened}{text}{closed}" if carry else text for carry, text in sample["runs"]))
    lengths = report["lengths"]
    lines += ["", f"sample lengths (tokens, {lengths['count']:,} samples): p50 {lengths['p50']:,}, p90 {lengths['p90']:,},"
                  f" p99 {lengths['p99']:,}, max {lengths['max']:,}, mean {lengths['mean']:,}"]
    lines.append(f"tokens that carry loss: {report['target_tokens']:,} of {report['tokens']:,}"
                 f" ({report['loss_token_share']:.1%}) in the {report['samples']:,} samples kept")
    policy = report["length_policy"]
    if policy:
        if policy.get("truncate"):
            what = f"{policy['samples_truncated']:,} cut to {report['seq_len']} tokens (--truncate)"
        else:
            what = f"{policy['samples_dropped_long']:,} dropped as longer than {report['seq_len']} tokens (--truncate cuts them)"
        extra = (f", {policy['samples_dropped_no_target']:,} dropped with nothing left to train on"
                 if policy["samples_dropped_no_target"] else "")
        lines.append(f"at --seq-len {report['seq_len']}: {what}{extra}; {policy['target_tokens_lost']:,} target tokens lost")
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

    Conversations and prompt-completion samples are never cut across windows, so the planned length is
    the longest sample, or the p99 length when a few outliers are over 1.5x longer (those would be dropped,
    or cut with --truncate). Plain text is cut into windows of any length: --seq-len stays as given.
    A --seq-len the user gave is kept.
    """
    import numpy as np

    lengths, supervised = _sample_lengths(config)
    quantiles = {f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 99)}
    longest = int(lengths.max())
    facts: dict[str, Any] = {"samples": len(lengths), **quantiles, "max": longest}
    given = "seq_len" in (config.user_set or ())
    if not supervised or given:
        seq_len = config.data.seq_len
        facts["basis"] = "plain text, cut into windows of --seq-len" if not supervised else "--seq-len as given"
    elif longest <= 1.5 * quantiles["p99"]:
        seq_len, facts["basis"] = longest, "the longest sample"
    else:
        seq_len, facts["basis"] = quantiles["p99"], "the p99 sample length (a few outliers are far longer)"
    seq_len = max(seq_len, 2)
    facts["seq_len"] = seq_len
    facts["samples_longer"] = int((lengths > seq_len).sum()) if supervised else 0
    return (config if seq_len == config.data.seq_len else config.replace(seq_len=seq_len)), facts


def describe_plan_basis(dataset: str, facts: dict[str, Any]) -> str:
    line = (f"planned at --seq-len {facts['seq_len']:,}: {facts['basis']} of {dataset} ({facts['samples']:,} samples;"
            f" p50 {facts['p50']:,}, p90 {facts['p90']:,}, p99 {facts['p99']:,}, max {facts['max']:,} tokens)")
    if facts["samples_longer"]:
        line += f"; {facts['samples_longer']:,} longer samples would be dropped (--truncate cuts them)"
    return line


def _sample_lengths(config: Any) -> tuple[Any, bool]:
    """Token counts of every sample of config.data.dataset (whole, before any length policy), and whether it is
    a supervised format. Tokenized into a temporary directory unless --cache-dir is given."""
    import numpy as np

    from memfit.data import load_training_data
    from memfit.models.loader import load_tokenizer

    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="memfit-data-") as scratch:
        # No length policy and one document a window: every sample is seen whole.
        data_cfg = dataclasses.replace(config.data, cache_dir=config.data.cache_dir or scratch, seq_len=1 << 30,
                                       stride=0, packing="off", truncate=False)
        dataset = load_training_data(data_cfg, tokenizer)
        if getattr(dataset, "supervised", False):
            return np.diff(np.asarray(dataset.store.offsets)), True
        return np.asarray(dataset.lengths, dtype=np.int64).copy(), False

"""What `memfit data --task dpo|simpo|orpo|kto` shows: a pair as the model sees it, what is scored, the lengths."""

from __future__ import annotations

import logging
from typing import Any

from memfit.data.preference_tokens import PreferencePair, UnpairedCompletion
from memfit.data.preferences import LengthDistribution, PreferenceDataset, length_lines

logger = logging.getLogger(__name__)


# -- what `memfit data --task dpo` shows -----------------------------------------------------------------------------


def preference_report(dataset: PreferenceDataset, tokenizer: Any, show: int = 3) -> dict[str, Any]:
    """What `memfit data` shows of preference data, as a JSON-ready dict: the first `show` kept items decoded from
    their tokens (prompt, then each scored completion) with their ids, the lengths of each part, the pair-length
    distribution, the scored share and what the length does."""
    lengths = dataset.segment_lengths
    parts = {name: LengthDistribution.of(lengths[:, k]).as_dict() for k, name in enumerate(dataset.segment_names)}
    shown = []
    for index in range(min(show, len(dataset))):
        item = dataset[index]
        whole = dataset.whole(int(dataset.policy.kept[index]))
        completions = ([("chosen", item.chosen_ids), ("rejected", item.rejected_ids)]
                       if isinstance(item, PreferencePair) else [("completion", item.completion_ids)])
        entry: dict[str, Any] = {
            "record": item.record, "prompt": tokenizer.decode(item.prompt_ids), "prompt_ids": item.prompt_ids,
            "completions": [{"name": name, "text": tokenizer.decode(ids), "ids": ids, "scored_tokens": len(ids)}
                            for name, ids in completions],
            "cut": item.length < whole.length,
        }
        if isinstance(item, UnpairedCompletion):
            entry["label"] = item.label
        shown.append(entry)
    policy = dataset.policy.facts()
    if dataset.policy.from_data is not None:
        policy["seq_len_choice"] = dataset.policy.from_data.describe()
    return {
        "preference": True, "dataset": dataset.source, "format": dataset.format, "task": dataset.task, "paired": dataset.paired,
        "conversational": dataset.conversational, "chat_template": dataset.template_name, "seq_len": dataset.seq_len,
        "records": dataset.records, "items": dataset.num_items, "kept": len(dataset),
        "lengths": {"item": dataset.length_distribution().as_dict(), **parts},
        "tokens": dataset.num_tokens, "scored_tokens": dataset.num_target_tokens,
        "scored_share": round(dataset.num_target_tokens / max(1, dataset.num_tokens), 4),
        "cost_at_seq_len": dataset.cost_at(dataset.seq_len).as_dict(),
        "length_policy": policy, "length_lines": length_lines(dataset),
        "prompt_boundary_mismatches": dataset.prompt_boundary_mismatches,
        "desirable": dataset.desirable, "shown": shown,
    }


def describe_preference_data(report: dict[str, Any], color: bool = False, marks: tuple[str, str] = ("[[", "]]"),
                             colors: tuple[str, str] = ("\033[1;32m", "\033[0m")) -> str:
    """`preference_report` in words: each shown item's prompt, then its completions with the scored tokens marked
    (`marks`, or `colors` on a terminal), the lengths and what the length does."""
    opened, closed = colors if color else marks
    marked = "in green" if color else f"between {marks[0]} and {marks[1]}"
    noun = "pairs" if report["paired"] else "completions"
    kind = "conversational" if report["conversational"] else "plain text"
    template = f", chat template {report['chat_template']}" if report["chat_template"] else ""
    lines = [f"{report['dataset']}: {report['records']:,} records, format {report['format']} ({kind}{template}),"
             f" {report['items']:,} {noun} for --task {report['task']}; scored: the completions' tokens"]
    for number, item in enumerate(report["shown"], start=1):
        sizes = ", ".join(f"{c['name']} {c['scored_tokens']}" for c in item["completions"])
        label = "" if "label" not in item else (", desirable" if item["label"] else ", undesirable")
        cut = f", cut to --seq-len {report['seq_len']}" if item["cut"] else ""
        lines += ["", f"--- {noun[:-1]} {number} (record {item['record']}{label}): prompt {len(item['prompt_ids'])}"
                      f" tokens, {sizes} scored (shown {marked}){cut} ---", "prompt:", item["prompt"]]
        for completion in item["completions"]:
            lines += [f"{completion['name']}:", f"{opened}{completion['text']}{closed}"]
    lengths = report["lengths"]
    whole = lengths["item"]
    what = "longer of prompt+chosen and prompt+rejected" if report["paired"] else "prompt+completion"
    lines += ["", f"{noun[:-1]} lengths (tokens, the {what}; {whole['count']:,} {noun}): median {whole['median']:,},"
                  f" p99 {whole['p99']:,}, max {whole['max']:,}, mean {whole['mean']:,}"]
    lines.append("parts (median / p99 / max): " + "; ".join(
        f"{name} {lengths[name]['median']:,} / {lengths[name]['p99']:,} / {lengths[name]['max']:,}"
        for name in lengths if name != "item"))
    lines.append(f"scored tokens: {report['scored_tokens']:,} of {report['tokens']:,} ({report['scored_share']:.1%})"
                 f" in the {report['kept']:,} {noun} kept" + ("" if not report["paired"] else ", each prompt run twice"))
    if report.get("desirable") is not None:
        lines.append(f"labels: {report['desirable']:,} desirable, {report['kept'] - report['desirable']:,} undesirable")
    cost = report["cost_at_seq_len"]
    lines += report["length_lines"] or [f"at --seq-len {report['seq_len']}: every one of the {report['items']:,}"
                                        f" {noun} fits whole (the longest has {whole['max']:,} tokens)"]
    if cost["cut"] and not report["length_policy"].get("truncate"):
        lines.append(f"cut as TRL cuts (--truncate): {cost['cut']:,} {noun} would lose the ends of their completions,"
                     f" {cost['dropped']:,} dropped")
    if report["prompt_boundary_mismatches"]:
        lines.append(f"{report['prompt_boundary_mismatches']:,} records: the tokenized prompt is not the start of the"
                     " tokenized prompt + completion; the prompt ends where they agree")
    return "\n".join(lines)

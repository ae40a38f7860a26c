"""Prompt datasets for --task grpo, in TRL's formats, tokenized as TRL's GRPOTrainer feeds them to generation.

A record has a `prompt` (`--prompt-field`): a string (plain) or a list of {"role", "content"} messages
(conversational). Every other field is kept, per prompt, for the reward functions (an `answer` column for the
built-in answer-match). JSONL, Parquet and `hf:` datasets are read (records.py); `builtin:prompts` is a small set
of arithmetic questions with their answers shipped with memfit (data/chat/prompts.jsonl).

Tokens, as TRL 1.16 (GRPOTrainer `_tokenize_prompts`): a plain prompt is tokenized as text with the tokenizer's
special tokens (its BOS, when it adds one); a conversational prompt is rendered by the chat template with the
generation prompt (`add_generation_prompt=True`), and the rendered text tokenized without adding special tokens
(the template writes them). `--max-prompt-length` keeps the last tokens, as TRL's left truncation side does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from memfit.data.records import iter_records, resolve
from memfit.data.samples import BUILTIN_TOKENIZER_TEMPLATE, BYTE_TOKENIZER_FINGERPRINT
from memfit.data.sources import TextSource
from memfit.data.templates import resolve_chat_template
from memfit.errors import UsageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One prompt, ready for generation."""

    prompt: str | list[dict]
    """The record's prompt as written: text, or the list of messages."""
    prompt_ids: list[int]
    """Its tokens as generation reads them (the last --max-prompt-length of them)."""
    columns: dict[str, Any]
    """The record's other fields, passed to the reward functions by name."""


def is_conversational_prompt(prompt: Any) -> bool:
    """A list of {"role", "content"} messages (TRL's conversational format)."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(message, dict) and "role" in message and "content" in message for message in prompt)


def read_prompt_records(source: TextSource, prompt_field: str = "prompt") -> list[dict]:
    """The records of `source`, each with a string or message-list prompt.

    Raises UsageError naming the fields found when a record has no prompt, or the prompt is neither form."""
    records = []
    for number, record in enumerate(iter_records(source), start=1):
        if not isinstance(record, dict) or prompt_field not in record:
            found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise UsageError(f"{source.label} record {number} has no {prompt_field!r} field (found: {found}); --task grpo"
                             f" reads prompts: pass --prompt-field NAME or give each record a {prompt_field!r}")
        prompt = record[prompt_field]
        if not isinstance(prompt, str) and not is_conversational_prompt(prompt):
            raise UsageError(f"{source.label} record {number}: {prompt_field!r} must be text or a list of"
                             " {\"role\", \"content\"} messages")
        records.append(record)
    if not records:
        raise UsageError(f"{source.label} has no records; --task grpo needs prompts")
    return records


class PromptTokenizer:
    """Prompts -> the token ids TRL's GRPOTrainer generates from (module docstring)."""

    def __init__(self, tokenizer: Any, template: str | None = None, max_prompt_length: int | None = None,
                 label: str = "the data") -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.max_prompt_length = max_prompt_length
        self.label = label
        self.truncated = 0
        """Prompts that lost their first tokens to max_prompt_length."""

    def __call__(self, prompt: str | list[dict], number: int = 0) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt, verbose=False)["input_ids"])
        else:
            ids = self._render(prompt, number)
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            self.truncated += 1
            ids = ids[-self.max_prompt_length:]
        return ids

    def _render(self, messages: list[dict], number: int) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.template,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja2 errors and the template's own raise_exception()
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"{self.label} record {number}: the chat template failed ({first}); check the template"
                             " or the record") from None
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _template(data_cfg: Any, tokenizer: Any) -> str | None:
    """The Jinja text to render with (None: the tokenizer's own); memfit's byte tokenizer, which has none, uses chatml."""
    choice = getattr(data_cfg, "chat_template", None)
    if not choice and not getattr(tokenizer, "chat_template", None) and (
            getattr(tokenizer, "fingerprint", None) == BYTE_TOKENIZER_FINGERPRINT):
        choice = BUILTIN_TOKENIZER_TEMPLATE
    template = resolve_chat_template(tokenizer, choice, getattr(tokenizer, "name_or_path", "") or "the model")
    if not choice:
        return None
    tokenizer.chat_template = template  # the saved model then renders conversations the same way
    return template


def load_prompts(data_cfg: Any, tokenizer: Any, *, max_prompt_length: int | None = None, say: bool = True
                 ) -> list[PromptItem]:
    """The tokenized prompts of `data_cfg.dataset` (reads dataset, text_field, prompt_field, chat_template).

    Raises UsageError for a record without a prompt, a missing or failing chat template."""
    source = resolve(data_cfg.dataset, data_cfg.text_field)
    prompt_field = getattr(data_cfg, "prompt_field", "prompt") or "prompt"
    records = read_prompt_records(source, prompt_field)
    conversational = any(not isinstance(record[prompt_field], str) for record in records)
    template = _template(data_cfg, tokenizer) if conversational else None
    tokenize = PromptTokenizer(tokenizer, template, max_prompt_length, source.label)
    items = [PromptItem(prompt=record[prompt_field], prompt_ids=tokenize(record[prompt_field], number),
                        columns={k: v for k, v in record.items() if k != prompt_field})
             for number, record in enumerate(records, start=1)]
    if say and tokenize.truncated:
        logger.warning("memfit: %s: %d of %d prompts are longer than --max-prompt-length %d; their first tokens are"
                       " left out (the last ones kept)", source.label, tokenize.truncated, len(items), max_prompt_length)
    return items


# -- what `memfit data --task grpo` shows ----------------------------------------------------------------------------


def prompt_report(items: list[PromptItem], tokenizer: Any, *, dataset: str, max_prompt_length: int | None = None,
                  show: int = 3) -> dict[str, Any]:
    """What `memfit data --task grpo` shows, as a JSON-ready dict: the first `show` prompts as generation reads them
    (decoded from their tokens, with their ids), the prompt lengths and the columns the reward functions receive."""
    import numpy as np

    lengths = np.asarray([len(item.prompt_ids) for item in items], dtype=np.int64)
    columns = sorted({name for item in items for name in item.columns})
    shown = [{"record": number, "prompt": tokenizer.decode(item.prompt_ids), "prompt_ids": item.prompt_ids,
              "columns": item.columns} for number, item in enumerate(items[:show], start=1)]
    return {
        "prompts": True, "dataset": dataset, "records": len(items),
        "conversational": any(not isinstance(item.prompt, str) for item in items),
        "max_prompt_length": max_prompt_length,
        "prompt_lengths": {"count": len(lengths), "mean": round(float(lengths.mean()), 1),
                           **{f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 99)},
                           "max": int(lengths.max())},
        "cut": int((lengths >= max_prompt_length).sum()) if max_prompt_length else 0,
        "reward_columns": columns, "shown": shown,
    }


def describe_prompt_data(report: dict[str, Any]) -> str:
    """`prompt_report` in words: each shown prompt as the model reads it, its columns, then the lengths."""
    kind = "conversational, rendered by the chat template with the generation prompt" if report["conversational"] \
        else "plain text"
    columns = ", ".join(report["reward_columns"]) or "none"
    lines = [f"{report['dataset']}: {report['records']:,} prompts for --task grpo ({kind});"
             f" columns passed to the reward functions: {columns}"]
    for item in report["shown"]:
        lines += ["", f"--- prompt {item['record']}: {len(item['prompt_ids'])} tokens, as generation reads them ---",
                  item["prompt"], "columns: " + json.dumps(item["columns"], ensure_ascii=False, default=str)]
    length = report["prompt_lengths"]
    lines += ["", f"prompt lengths (tokens; {length['count']:,} prompts): median {length['p50']:,}, p90 {length['p90']:,},"
                  f" p99 {length['p99']:,}, max {length['max']:,}, mean {length['mean']:,}"]
    if report["max_prompt_length"]:
        lines.append(f"--max-prompt-length {report['max_prompt_length']:,}: {report['cut']:,} prompts reach it (a longer"
                     " prompt keeps its last tokens)")
    return "\n".join(lines)

"""Preference records -> token ids of the prompt and of each completion, as TRL 1.16's DPOTrainer and KTOTrainer
tokenize them (the rules are in memfit.data.preferences' docstring; tests compare against TRL's own code)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from memfit.data.preference_records import Conversation, PairRecord, UnpairedRecord, Value
from memfit.errors import UsageError

logger = logging.getLogger(__name__)


# -- tokens ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferencePair:
    """A pair as the model reads it: the prompt's tokens, then either completion's. The completions are scored."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    record: int = 0
    """The record it came from (1-based), for messages."""

    @property
    def length(self) -> int:
        """Tokens of the longer sequence, max(prompt + chosen, prompt + rejected): what a batch row must hold."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))

    @property
    def scored_tokens(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)

    def chosen_input_ids(self) -> list[int]:
        return self.prompt_ids + self.chosen_ids

    def rejected_input_ids(self) -> list[int]:
        return self.prompt_ids + self.rejected_ids

    def cut(self, max_length: int) -> PreferencePair:
        """Each sequence cut to its first `max_length` tokens (TRL's keep_start); the prompt must be shorter."""
        room = max_length - len(self.prompt_ids)
        if room <= 0:
            raise ValueError(f"a prompt of {len(self.prompt_ids)} tokens leaves nothing of the completions in {max_length}")
        return PreferencePair(self.prompt_ids, self.chosen_ids[:room], self.rejected_ids[:room], self.record)


@dataclass(frozen=True)
class UnpairedCompletion:
    """A completion as the model reads it (prompt, then completion, the completion scored) and its label."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    """True: a desirable completion."""
    record: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def scored_tokens(self) -> int:
        return len(self.completion_ids)

    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def cut(self, max_length: int) -> UnpairedCompletion:
        """The sequence cut to its first `max_length` tokens; the prompt must be shorter."""
        room = max_length - len(self.prompt_ids)
        if room <= 0:
            raise ValueError(f"a prompt of {len(self.prompt_ids)} tokens leaves nothing of the completion in {max_length}")
        return UnpairedCompletion(self.prompt_ids, self.completion_ids[:room], self.label, self.record)


class PreferenceTokenizer:
    """Records -> token ids, the way TRL's DPOTrainer and KTOTrainer prepare them (module docstring).

    `template`: the Jinja text of `--chat-template`, or None for the tokenizer's own (chosen by transformers as TRL
    has it chosen, a tool-use template included). Counts the records whose tokenized prompt is not a prefix of
    their tokenized prompt + completion (`prompt_boundary_mismatches`).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, label: str = "the data") -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.label = label
        self.prompt_boundary_mismatches = 0
        self.first_mismatch: str | None = None
        """The prompt's tokens left out of the first record that had some, decoded (said once, as TRL says it)."""

    def pair(self, record: PairRecord) -> PreferencePair:
        prompt, chosen, rejected = self._split(record, [record.chosen, record.rejected])
        return PreferencePair(prompt, chosen, rejected, record.number)

    def unpaired(self, record: UnpairedRecord) -> UnpairedCompletion:
        prompt, completion = self._split(record, [record.completion])
        return UnpairedCompletion(prompt, completion, record.label, record.number)

    def _split(self, record: PairRecord | UnpairedRecord, completions: list[Value]) -> list[list[int]]:
        """[prompt ids, then each completion's ids]: the common start of the tokenized prompt and of every tokenized
        prompt + completion is the prompt, the rest of each sequence its completion."""
        if record.conversational:
            prompt_ids = self._render(record, record.prompt, generation_prompt=True)
            sequences = [self._render(record, record.prompt + completion, generation_prompt=False)
                         for completion in completions]
        else:
            eos = self._eos()
            prompt_ids = self._text(record.prompt)
            sequences = [self._text(record.prompt + (text if text.endswith(eos) else text + eos))
                         for text in completions]
        shared = min(_common_prefix(prompt_ids, sequence) for sequence in sequences)
        if shared < len(prompt_ids):
            self.prompt_boundary_mismatches += 1
            if self.first_mismatch is None:
                self.first_mismatch = self.tokenizer.decode(prompt_ids[shared:])
        for sequence in sequences:
            if len(sequence) == shared:
                raise UsageError(f"{self.label} record {record.number}: a completion has no tokens of its own after"
                                 " the prompt, so nothing of it would be scored; fix the record or drop it")
        return [prompt_ids[:shared]] + [sequence[shared:] for sequence in sequences]

    def _render(self, record: PairRecord | UnpairedRecord, turns: Conversation, generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tools=record.tools, add_generation_prompt=generation_prompt,
                tokenize=False, **record.template_kwargs)
        except Exception as error:  # jinja2 errors and the template's own raise_exception()
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"{self.label} record {record.number}: the chat template failed ({first}); check the"
                             " template or the record") from None
        # apply_chat_template(tokenize=True) tokenizes the rendered text so: the template wrote the special tokens.
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, verbose=False)["input_ids"])

    def _eos(self) -> str:
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos:
            raise UsageError("plain-text preference data ends each completion with the tokenizer's EOS token, and this"
                             " tokenizer has none; use a tokenizer with one, or conversational records")
        return eos


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length

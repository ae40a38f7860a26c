"""Chat templates: conversations rendered by the tokenizer's own `apply_chat_template`.

The template is the tokenizer's `chat_template` unless `--chat-template` names one memfit ships
(written for this project, for base models that have none) or a Jinja file. The text a sample is
tokenized from is exactly what `apply_chat_template` renders, and its tokens are what
`apply_chat_template(..., tokenize=True)` gives (the rendered text, special tokens not added
again), so training sees what inference will.

A template given with `--chat-template` is set on the tokenizer, so the tokenizer saved with the
final model renders conversations the same way at inference.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

BUNDLED = ("chatml", "llama3", "system-default")


def bundled_template(name: str) -> str:
    """The Jinja text of a template shipped with memfit."""
    return resources.files("memfit.data").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def resolve_chat_template(tokenizer: Any, choice: str | None, model_label: str = "the model") -> str:
    """The Jinja template conversations are rendered with.

    `choice`: None (the tokenizer's own), a bundled name, or a path to a Jinja file.
    Raises UsageError when there is none, or the file cannot be read.
    """
    if choice:
        if choice in BUNDLED:
            return bundled_template(choice)
        path = Path(choice).expanduser()
        if not path.is_file():
            raise UsageError(
                f"--chat-template {choice}: no such bundled template or file; use one of {', '.join(BUNDLED)} or a .jinja file"
            )
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise UsageError(f"--chat-template {choice} is empty; give a Jinja chat template")
        return text
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # tokenizers with several named templates keep the main one as "default"
        own = own.get("default")
    if not own:
        raise UsageError(
            f"the tokenizer of {model_label} has no chat template to render conversations with;"
            f" pass --chat-template {'|'.join(BUNDLED)} or a .jinja file"
        )
    return own


def template_fingerprint(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16]


class ChatRenderer:
    """Render conversations with one template through the tokenizer's `apply_chat_template`."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        if not hasattr(tokenizer, "apply_chat_template"):
            raise UsageError("conversations need a Hugging Face tokenizer (one with apply_chat_template); pass --tokenizer")
        self.tokenizer = tokenizer
        self.template = template

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:  # jinja2 errors and the template's own raise_exception()
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"the chat template failed on a conversation ({first}); check the template or the record") from None

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """Token ids of rendered text as apply_chat_template(tokenize=True) makes them, with character
        offsets when the tokenizer gives them (fast tokenizers)."""
        if getattr(self.tokenizer, "is_fast", False):
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            return list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

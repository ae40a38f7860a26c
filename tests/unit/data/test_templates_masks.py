"""Loss masks for three real template styles, checked token by token against spans built here independently.

The expected tokens of each conversation are assembled piece by piece from the template's layout
(header, content, end of turn), each piece tokenized on its own (the byte tokenizer has no merges,
so pieces concatenate exactly); which pieces carry loss is decided here, not by the code under test.
"""

from __future__ import annotations

import pytest

from memfit.data.formats import FieldNames, to_example
from memfit.data.masks import TemplateSplitError, build_sample
from memfit.data.templates import BUNDLED, ChatRenderer, bundled_template, resolve_chat_template
from memfit.errors import UsageError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen-like: a default system prompt when the conversation brings none.
SYSTEM_DEFAULT = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + CHATML_LIKE
)
# No generation prompt at all (most base-model templates): the answer is found by its content.
NO_GENERATION_PROMPT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '<|eot_id|>' if m['role'] == 'assistant' else '\n' }}{% endfor %}"

SYSTEM = "Be brief."
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": " 12, since 4 x 3 = 12. "},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from memfit.models.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


def pieces(style: str, messages: list[dict]) -> list[tuple[str, str | None]]:
    """The template's layout as (text, role of the answer it belongs to or None) pieces."""
    out: list[tuple[str, str | None]] = []
    if style == "system-default" and messages[0]["role"] != "system":
        out.append(("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", None))
    for index, m in enumerate(messages):
        answer = index if m["role"] == "assistant" else None
        if style == "llama3":
            out += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", None), (m["content"].strip() + "<|eot_id|>", answer)]
        elif style in ("chatml", "system-default"):
            out += [(f"<|im_start|>{m['role']}\n", None), (m["content"] + "<|im_end|>\n", answer)]
        else:  # no generation prompt: the answer starts where its written content does (after any spaces)
            content = m["content"]
            lead = content[: len(content) - len(content.lstrip())]
            end = "<|eot_id|>" if m["role"] == "assistant" else "\n"
            out += [(f"{m['role']}: {lead}", None), (content.lstrip() + end, answer)]
    return out


def expected(tokenizer, style: str, messages: list[dict], trained: set[int] | None) -> tuple[list[int], list[bool]]:
    """Tokens and loss flags; `trained`: indices of the answers that carry loss (None: every token)."""
    ids, flags = [], []
    for text, answer in pieces(style, messages):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        flags += [trained is None or (answer is not None and answer in trained)] * len(piece)
    return ids, flags


TEMPLATES = {"llama3": LLAMA3_LIKE, "chatml": CHATML_LIKE, "system-default": SYSTEM_DEFAULT, "plain": NO_GENERATION_PROMPT}


@pytest.mark.parametrize("style", list(TEMPLATES))
@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_masks_match_independent_spans_token_by_token(tokenizer, style, with_system, train_on):
    messages = ([{"role": "system", "content": SYSTEM}] if with_system else []) + CONVERSATION
    example = to_example({"messages": messages}, "messages", 1, FieldNames(), "d")
    renderer = ChatRenderer(tokenizer, TEMPLATES[style])
    ids, mask = build_sample(renderer, tokenizer, example, train_on)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained = None if train_on == "all" else set(answers[-1:] if train_on == "last" else answers)
    want_ids, want_mask = expected(tokenizer, style, messages, trained)
    assert ids == want_ids
    assert mask == want_mask
    # What inference tokenizes for the same conversation with the same template.
    assert ids == list(tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[style], tokenize=True)["input_ids"])
    if train_on != "all":
        assert sum(mask) < len(mask) and any(mask)


def test_a_template_that_rewrites_earlier_turns_is_refused_clearly(tokenizer):
    # Drops the content of every answer but the last (as reasoning templates drop earlier thinking).
    rewriting = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    example = to_example({"messages": CONVERSATION}, "messages", 1, FieldNames(), "d")
    renderer = ChatRenderer(tokenizer, rewriting)
    with pytest.raises(TemplateSplitError, match="renders a turn differently.*--train-on-prompt") as caught:
        build_sample(renderer, tokenizer, example, "assistant")
    assert "\n" not in str(caught.value)
    ids, mask = build_sample(renderer, tokenizer, example, "all")  # every token: no split needed
    assert all(mask) and len(ids) == len(mask)


def test_fault_twin_a_mask_shifted_by_one_token_fails_the_comparison(tokenizer):
    """The comparison above sees an off-by-one span (the end-of-turn token left out)."""
    messages = CONVERSATION
    example = to_example({"messages": messages}, "messages", 1, FieldNames(), "d")
    ids, mask = build_sample(ChatRenderer(tokenizer, CHATML_LIKE), tokenizer, example, "assistant")
    _, want = expected(tokenizer, "chatml", messages, {1, 3, 5})
    shifted = [False] + mask[:-1]
    assert mask == want and shifted != want


def test_plain_prompt_completion_trains_the_completion_and_eos(tokenizer):
    example = to_example({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, "prompt-completion", 1, FieldNames(), "d")
    ids, mask = build_sample(None, tokenizer, example, "assistant")
    prompt = tokenizer("Q: 2+2?\nA:")["input_ids"]
    completion = tokenizer(" 4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt + completion
    assert mask == [False] * len(prompt) + [True] * len(completion)
    assert all(build_sample(None, tokenizer, example, "all")[1])


def test_conversational_prompt_completion_trains_only_the_completion(tokenizer):
    record = {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:4]}
    example = to_example(record, "prompt-completion", 1, FieldNames(), "d")
    ids, mask = build_sample(ChatRenderer(tokenizer, CHATML_LIKE), tokenizer, example, "assistant")
    want_ids, want_mask = expected(tokenizer, "chatml", CONVERSATION[:4], {3})
    assert (ids, mask) == (want_ids, want_mask)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_templates_split_into_answers(tokenizer, name):
    example = to_example({"messages": CONVERSATION}, "messages", 1, FieldNames(), "d")
    renderer = ChatRenderer(tokenizer, bundled_template(name))
    ids, mask = build_sample(renderer, tokenizer, example, "assistant")
    answered = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    for turn in CONVERSATION:
        assert (turn["content"].strip() in answered) == (turn["role"] == "assistant")


def test_a_tokenizer_without_template_is_refused_with_a_hint(tokenizer, tmp_path):
    assert not tokenizer.chat_template
    with pytest.raises(UsageError, match=r"has no chat template.*--chat-template chatml\|llama3\|system-default"):
        resolve_chat_template(tokenizer, None, "my-model")
    assert resolve_chat_template(tokenizer, "chatml") == bundled_template("chatml")
    custom = tmp_path / "mine.jinja"
    custom.write_text(CHATML_LIKE)
    assert resolve_chat_template(tokenizer, str(custom)) == CHATML_LIKE
    with pytest.raises(UsageError, match="no such bundled template or file"):
        resolve_chat_template(tokenizer, "chatm")

"""Which tokens of a sample carry loss: the answers, found by rendering, not by template markers.

Most chat templates have no `{% generation %}` markers, so the assistant spans are found by
rendering prefixes of the conversation with the same template:

    before = render(turns[:i], add_generation_prompt=True)   # everything up to the answer
    after  = render(turns[:i + 1])                            # ... and the answer, end of turn included

The characters between the two are turn i's answer; with the tokenizer's character offsets they
become tokens of the whole rendered conversation (tokenized once, as inference tokenizes it).
A template that renders a turn differently once a later turn follows (one that drops earlier
reasoning, say) fails the prefix check: that is said in one line instead of training on a wrong mask.

Policies (`--train-on`): `assistant` (default) every trainable turn with its end-of-turn token;
`last` only the final one; `all` (`--train-on-prompt`) every token.
"""

from __future__ import annotations

from memfit.data.formats import Example
from memfit.data.templates import ChatRenderer
from memfit.errors import UsageError

TRAIN_ON = ("assistant", "last", "all")


class TemplateSplitError(UsageError):
    """The template cannot be split into turns by rendering prefixes."""


def build_sample(renderer: ChatRenderer | None, tokenizer, example: Example, train_on: str) -> tuple[list[int], list[bool]]:
    """(token ids, whether each token carries loss) of one example under policy `train_on`."""
    if not example.conversational:
        return _plain(tokenizer, example, train_on)
    assert renderer is not None
    full = renderer.render(example.messages)
    ids, offsets = renderer.encode(full)
    if train_on == "all":
        return ids, [True] * len(ids)
    turns = example.trainable[-1:] if train_on == "last" else example.trainable
    spans = [assistant_span(renderer, example.messages, turn, full) for turn in turns]
    if offsets is not None:
        mask = [any(start < stop and end > begin for begin, stop in spans) for start, end in offsets]
    else:
        mask = [False] * len(ids)
        for begin, stop in spans:
            first, last = _prefix_tokens(renderer, full, begin, ids), _prefix_tokens(renderer, full, stop, ids)
            for index in range(first, last):
                mask[index] = True
    return ids, mask


def assistant_span(renderer: ChatRenderer, messages: list[dict], turn: int, full: str) -> tuple[int, int]:
    """Character span [begin, end) of turn `turn`'s answer (end-of-turn text included) in `full`."""
    after = renderer.render(messages[: turn + 1])
    before = renderer.render(messages[:turn]) if turn else ""
    if not full.startswith(after) or not after.startswith(before):
        raise TemplateSplitError(
            "the chat template renders a turn differently once later turns follow, so the answers cannot be found by"
            " rendering; pass --train-on-prompt (train on every token) or --chat-template with a template that renders"
            " turns in order"
        )
    prompted = renderer.render(messages[:turn], add_generation_prompt=True) if turn else ""
    if len(prompted) > len(before) and after.startswith(prompted):
        return len(prompted), len(after)
    # No generation prompt to lean on: the answer starts where its content does.
    content = messages[turn].get("content")
    text = content.strip() if isinstance(content, str) else ""
    begin = after.find(text, len(before)) if text else -1
    if begin < 0:
        raise TemplateSplitError(
            "the chat template has no generation prompt and does not show an assistant turn's content as written,"
            " so the answers cannot be found by rendering; pass --train-on-prompt or another --chat-template"
        )
    return begin, len(after)


def _prefix_tokens(renderer: ChatRenderer, full: str, chars: int, ids: list[int]) -> int:
    """Tokens covering the first `chars` characters, for tokenizers without offsets."""
    head, _ = renderer.encode(full[:chars])
    if ids[: len(head)] != head:
        raise TemplateSplitError(
            "the tokenizer merges tokens across a turn boundary and gives no character offsets, so the answers cannot"
            " be masked exactly; use a fast tokenizer or pass --train-on-prompt"
        )
    return len(head)


def _plain(tokenizer, example: Example, train_on: str) -> tuple[list[int], list[bool]]:
    """A string prompt and completion: the prompt as the tokenizer encodes text (BOS included where it adds
    one), then the completion and EOS, which ends the answer so the model learns to stop."""
    prompt = list(tokenizer(example.prompt)["input_ids"]) if example.prompt else []
    completion = list(tokenizer(example.completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        completion.append(int(tokenizer.eos_token_id))
    prompt_mask = train_on == "all"
    return prompt + completion, [prompt_mask] * len(prompt) + [True] * len(completion)

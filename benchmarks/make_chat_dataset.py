"""Write memfit's bundled chat dataset, src/memfit/data/chat/chat.jsonl (`--dataset builtin:chat`).

Every conversation is made here from small templates with answers computed in code (arithmetic,
conversions, word and list tasks, days of the week) plus short explanations of training terms
written for memfit, so every answer is correct and the whole set is CC0. Seeded: rerunning it
writes the same file.

    .venv/bin/python benchmarks/make_chat_dataset.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "memfit" / "data" / "chat" / "chat.jsonl"
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["memory", "gradient", "window", "token", "planet", "garden", "river", "candle", "yellow", "button",
         "kitten", "pencil", "rocket", "silver", "travel", "winter", "orange", "bridge", "forest", "violet"]
SYSTEMS = [None, None, None, "You are a concise assistant.", "You are a patient tutor: show the steps.",
           "Answer in one short sentence."]

CONCEPTS = {
    "gradient accumulation": (
        "Gradient accumulation runs several small micro-batches, adds up their gradients, and only then takes one"
        " optimizer step. The update is the one a single large batch would give, but only one micro-batch of"
        " activations is in memory at a time."),
    "gradient checkpointing": (
        "Gradient checkpointing keeps only some activations during the forward pass and recomputes the others"
        " during backward. It trades roughly one extra forward pass for a large cut in activation memory."),
    "LoRA": (
        "LoRA freezes the weights of a model and trains two small low-rank matrices beside each chosen layer."
        " Only those matrices need gradients and optimizer state, so fine-tuning fits in far less memory."),
    "mixed precision": (
        "Mixed precision runs most of the arithmetic in a 16-bit format such as bfloat16 while keeping sensitive"
        " values in 32-bit floats. It roughly halves activation memory and is faster on modern GPUs."),
    "a learning rate warmup": (
        "A warmup raises the learning rate from near zero to its peak over the first steps. Early gradients are"
        " noisy, and small first steps keep the optimizer's statistics from starting badly."),
    "a token": (
        "A token is the unit a language model reads and writes: a word, a piece of a word, or a single byte,"
        " depending on the tokenizer. Sequence lengths and training speed are counted in tokens."),
    "an epoch": "An epoch is one full pass over the training data.",
    "overfitting": (
        "Overfitting is when a model learns its training examples so closely that it does worse on new ones."
        " A held-out evaluation loss that rises while the training loss keeps falling is the usual sign."),
    "a chat template": (
        "A chat template turns a list of messages into the exact text a model was trained to read, with markers"
        " for who speaks. Training and inference must use the same template."),
    "the loss mask": (
        "The loss mask says which tokens the model is trained to predict. In chat fine-tuning it usually covers"
        " only the assistant's answers, so the model learns to answer rather than to imitate the user."),
    "packing": (
        "Packing places several short samples in one training window so that no compute is spent on padding."
        " Done right, each sample still attends only to itself and its positions start from zero."),
    "an optimizer": (
        "An optimizer turns gradients into weight updates. AdamW, the usual choice, keeps two running averages"
        " per weight, which is why its state takes twice the memory of the weights in 32-bit."),
}
CONCEPT_QUESTIONS = ["What is {}?", "Can you explain {} briefly?", "What does {} mean in model training?"]


def arithmetic(rng: random.Random, system: str | None) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = {"+": "plus", "-": "minus", "*": "times"}[op]
    if system and "tutor" in system:
        answer = f"We compute {a} {op} {b}. Working it through gives {value}. So {a} {name} {b} is {value}."
    elif system and "sentence" in system:
        answer = f"{a} {name} {b} is {value}."
    else:
        answer = f"{a} {op} {b} = {value}."
    turns = [{"role": "user", "content": rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {name} {b}.",
                                                    f"How much is {a} {name} {b}?"])},
             {"role": "assistant", "content": answer}]
    for _ in range(rng.choice([0, 0, 1, 2])):
        k = rng.randint(2, 9)
        kind = rng.choice(["double", "add", "times"])
        if kind == "double":
            question, value = "Now double that.", value * 2
            reply = f"Doubled, it is {value}."
        elif kind == "add":
            question, value = f"And if I add {k}?", value + k
            reply = f"Adding {k} gives {value}."
        else:
            question, value = f"Multiply the result by {k}.", value * k
            reply = f"That makes {value}."
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return turns


def conversion(rng: random.Random, system: str | None) -> list[dict]:
    kind = rng.choice(["m", "h", "kg", "min"])
    n = rng.randint(2, 40)
    question, answer = {
        "m": (f"How many centimeters are in {n} meters?", f"{n} meters is {n * 100} centimeters."),
        "h": (f"How many minutes are in {n} hours?", f"{n} hours is {n * 60} minutes."),
        "kg": (f"How many grams are in {n} kilograms?", f"{n} kilograms is {n * 1000} grams."),
        "min": (f"How many seconds are in {n} minutes?", f"{n} minutes is {n * 60} seconds."),
    }[kind]
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def word_task(rng: random.Random, system: str | None) -> list[dict]:
    word = rng.choice(WORDS)
    kind = rng.choice(["reverse", "count", "upper", "first", "letters"])
    if kind == "reverse":
        return [{"role": "user", "content": f"Spell '{word}' backwards."},
                {"role": "assistant", "content": f"'{word}' backwards is '{word[::-1]}'."}]
    if kind == "count":
        return [{"role": "user", "content": f"How many letters are in the word '{word}'?"},
                {"role": "assistant", "content": f"'{word}' has {len(word)} letters."}]
    if kind == "upper":
        return [{"role": "user", "content": f"Write '{word}' in capital letters."},
                {"role": "assistant", "content": word.upper()}]
    if kind == "first":
        return [{"role": "user", "content": f"What is the first letter of '{word}'?"},
                {"role": "assistant", "content": f"The first letter of '{word}' is '{word[0]}'."},
                {"role": "user", "content": "And the last one?"},
                {"role": "assistant", "content": f"The last letter is '{word[-1]}'."}]
    return [{"role": "user", "content": f"List the letters of '{word}', separated by commas."},
            {"role": "assistant", "content": ", ".join(word)}]


def list_task(rng: random.Random, system: str | None) -> list[dict]:
    numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 9))]
    shown = ", ".join(map(str, numbers))
    turns = [{"role": "user", "content": f"Sort these numbers from smallest to largest: {shown}."},
             {"role": "assistant", "content": ", ".join(map(str, sorted(numbers)))}]
    if rng.random() < 0.5:
        turns += [{"role": "user", "content": "What is their sum?"},
                  {"role": "assistant", "content": f"The sum is {sum(numbers)}."}]
    if rng.random() < 0.3:
        turns += [{"role": "user", "content": "Which one is the largest?"},
                  {"role": "assistant", "content": f"The largest is {max(numbers)}."}]
    return turns


def days(rng: random.Random, system: str | None) -> list[dict]:
    start, k = rng.randrange(7), rng.randint(1, 20)
    return [{"role": "user", "content": f"What day of the week is {k} days after {DAYS[start]}?"},
            {"role": "assistant", "content": f"{k} days after {DAYS[start]} is {DAYS[(start + k) % 7]}."}]


def parity(rng: random.Random, system: str | None) -> list[dict]:
    n = rng.randint(2, 200)
    prime = n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))
    return [{"role": "user", "content": f"Is {n} even or odd?"},
            {"role": "assistant", "content": f"{n} is {'even' if n % 2 == 0 else 'odd'}."},
            {"role": "user", "content": "Is it a prime number?"},
            {"role": "assistant", "content": f"{'Yes' if prime else 'No'}, {n} is {'' if prime else 'not '}prime."}]


def concept(rng: random.Random, system: str | None) -> list[dict]:
    names = rng.sample(sorted(CONCEPTS), rng.choice([1, 1, 2, 3]))
    turns = []
    for name in names:
        answer = CONCEPTS[name]
        if system and "sentence" in system:
            answer = answer.split(". ")[0].rstrip(".") + "."
        turns += [{"role": "user", "content": rng.choice(CONCEPT_QUESTIONS).format(name)},
                  {"role": "assistant", "content": answer}]
    return turns


def main(count: int = 400) -> None:
    rng = random.Random(0)
    kinds = [arithmetic, arithmetic, conversion, word_task, list_task, days, parity, concept, concept]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as handle:
        for _ in range(count):
            system = rng.choice(SYSTEMS)
            messages = ([{"role": "system", "content": system}] if system else []) + rng.choice(kinds)(rng, system)
            handle.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {count} conversations to {OUT}")


if __name__ == "__main__":
    main()

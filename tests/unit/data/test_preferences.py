"""Preference data: formats, TRL's tokens, the dataset of pairs, its lengths and what `memfit data` shows.

The tokens are checked against TRL's own data preparation (DPOTrainer._prepare_dataset and
KTOTrainer._prepare_dataset, run on the same records and tokenizer), on every format, on the bundled
file, and cut at a max length through TRL's collators. The tokenizer is a byte-level BPE trained here,
offline, on the bundled file: it merges across a prompt/completion boundary and adds a BOS to plain text,
so the places where TRL's rules matter are exercised.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from memfit.config_sections import DataConfig
from memfit.data.formats import FieldNames
from memfit.data.preference_view import describe_preference_data, preference_report
from memfit.data.preferences import (
    PREFERENCE_TASKS,
    UNPAIR_BATCH,
    PairRecord,
    PreferenceDataset,
    PreferencePair,
    UnpairedCompletion,
    apply_preference_policy,
    detect_preference_format,
    load_preference_data,
    split_implicit_prompt,
    unpair,
)
from memfit.data.records import builtin_path
from memfit.errors import UsageError

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The generation prompt opens an empty thought block that a rendered answer does not have: the tokenized prompt is
# then not the start of the tokenized prompt + completion (TRL cuts the prompt where they agree).
THINKING = CHATML_WITH_BOS.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think></think>{% endif %}")
# Tools and a template argument, which TRL passes from a record's `tools` and `chat_template_kwargs`.
WITH_TOOLS = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% if terse %}Be terse.\n{% endif %}"
              + CHATML_WITH_BOS)


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


EXPLICIT_CONVERSATIONS = [
    {"prompt": [turn("user", "How long should I boil an egg?")], "chosen": [turn("assistant", "About 6 minutes.")],
     "rejected": [turn("assistant", "Until done.")]},
    {"prompt": [turn("system", "Be brief."), turn("user", "Is 7 prime?"), turn("assistant", "Yes."),
                turn("user", "And 9?")],
     "chosen": [turn("assistant", "No, 9 is 3 times 3.")], "rejected": [turn("assistant", "Yes, it is prime.")]},
]
IMPLICIT_CONVERSATIONS = [
    {"chosen": [turn("user", "What is 15 percent of 80?"), turn("assistant", "12.")],
     "rejected": [turn("user", "What is 15 percent of 80?"), turn("assistant", "15.")]},
    {"chosen": [turn("system", "Answer in one line."), turn("user", "Name a vegetable."), turn("assistant", "Leek.")],
     "rejected": [turn("system", "Answer in one line."), turn("user", "Name a vegetable."), turn("assistant", "No.")]},
]
EXPLICIT_TEXT = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Water boils at ", "chosen": "100 degrees.", "rejected": "10 degrees."},  # merges across the boundary
    {"prompt": "Say hi:", "chosen": " hi</s>", "rejected": " bye"},  # an EOS already there is not added again
]
IMPLICIT_TEXT = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # the space before the difference: completions
    {"chosen": "Tea is hot", "rejected": "Tea is hotter"},  # one the start of the other: TRL's last shared character
]
UNPAIRED_CONVERSATIONS = [
    {"prompt": [turn("user", "Is the sky blue?")], "completion": [turn("assistant", "Yes, on a clear day.")],
     "label": True},
    {"prompt": [turn("user", "Is the sky blue?")], "completion": [turn("assistant", "It is purple.")], "label": False},
]
UNPAIRED_TEXT = [
    {"prompt": "The sun is", "completion": " a star.", "label": True},
    {"prompt": "The sun is", "completion": " a planet.", "label": False},
]
WITH_TEMPLATE_EXTRAS = [
    {"prompt": [turn("user", "Weather in Paris?")], "chosen": [turn("assistant", "Let me check.")],
     "rejected": [turn("assistant", "No idea.")], "tools": json.dumps([{"name": "weather", "parameters": {}}]),
     "chat_template_kwargs": {"terse": True}},
]
FORMATS = {
    "explicit conversational": (EXPLICIT_CONVERSATIONS, "preference"),
    "implicit conversational": (IMPLICIT_CONVERSATIONS, "implicit-preference"),
    "explicit text": (EXPLICIT_TEXT, "preference"),
    "implicit text": (IMPLICIT_TEXT, "implicit-preference"),
}


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained on the bundled file (merges), a BOS added to text, ChatML specials, a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(builtin_path("preferences").read_text().splitlines(), trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    built = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    built.chat_template = CHATML_WITH_BOS
    return built


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with another chat template (TRL renders with the tokenizer's own)."""
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def write(tmp_path, records: list[dict], name: str = "prefs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def load(dataset: str, tokenizer, task: str = "dpo", **data) -> PreferenceDataset:
    return load_preference_data(DataConfig(dataset=dataset, **data), tokenizer, task=task, say=False)


# -- TRL's own preparation, as the reference -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl():
    """TRL's DPO and KTO data preparation run on records: what its trainers train on (skipped without TRL)."""
    pytest.importorskip("trl")
    import datasets
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    datasets.disable_progress_bars()

    def dpo(records: list[dict], tokenizer, max_length: int | None = None) -> list[PreferencePair]:
        args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
        rows = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), datasets.Dataset.from_list(records),
                                           tokenizer, args, "train")
        return [PreferencePair(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in rows]

    def kto(records: list[dict], tokenizer, max_length: int | None = None) -> list[UnpairedCompletion]:
        args = SimpleNamespace(dataset_num_proc=None, max_length=max_length)
        owner = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False)
        rows = KTOTrainer._prepare_dataset(owner, datasets.Dataset.from_list(records), tokenizer, args, "eval")
        return [UnpairedCompletion(row["prompt_ids"], row["completion_ids"], bool(row["label"])) for row in rows]

    return SimpleNamespace(dpo=dpo, kto=kto, pair_collator=DataCollatorForPreference,
                           unpaired_collator=DataCollatorForUnpairedPreference)


def as_pairs(dataset: PreferenceDataset) -> list[tuple]:
    return [(i.prompt_ids, i.chosen_ids, i.rejected_ids) for i in map(dataset.whole, range(dataset.num_items))]


def as_completions(items) -> list[tuple]:
    return [(i.prompt_ids, i.completion_ids, i.label) for i in items]


def bundled_records() -> list[dict]:
    return [json.loads(line) for line in builtin_path("preferences").read_text().splitlines()]


@pytest.mark.parametrize("name", list(FORMATS))
def test_pairs_are_trls_tokens_on_every_format(name, tokenizer, trl, tmp_path):
    records, fmt = FORMATS[name]
    dataset = load(write(tmp_path, records), tokenizer)
    assert dataset.format == fmt and dataset.conversational == ("conversational" in name)
    expected = [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in trl.dpo(records, tokenizer)]
    assert as_pairs(dataset) == expected


def test_the_bundled_file_is_trls_tokens_for_pairs_and_for_kto(tokenizer, trl):
    records = bundled_records()
    pairs = load("builtin:preferences", tokenizer)
    assert as_pairs(pairs) == [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in trl.dpo(records, tokenizer)]
    assert pairs.prompt_boundary_mismatches == 0
    unpaired = load("builtin:preferences", tokenizer, task="kto")
    # TRL unpairs each batch of records as its chosen completions, then its rejected ones: the same order here.
    whole = [unpaired.whole(i) for i in range(unpaired.num_items)]
    assert as_completions(whole) == as_completions(trl.kto(records, tokenizer))
    assert [item.label for item in whole] == [True] * len(records) + [False] * len(records)


@pytest.mark.parametrize(("records", "kind"), [(UNPAIRED_CONVERSATIONS, True), (UNPAIRED_TEXT, False),
                                               (IMPLICIT_TEXT, False), (IMPLICIT_CONVERSATIONS, True)])
def test_kto_completions_are_trls_tokens(records, kind, tokenizer, trl, tmp_path):
    dataset = load(write(tmp_path, records), tokenizer, task="kto")
    assert dataset.conversational == kind and not dataset.paired
    whole = [dataset.whole(i) for i in range(dataset.num_items)]
    assert as_completions(whole) == as_completions(trl.kto(records, tokenizer))


def test_a_prompt_rendered_differently_alone_ends_where_trl_ends_it(tokenizer, trl, tmp_path, caplog):
    thinking = with_template(tokenizer, THINKING)
    with caplog.at_level("WARNING"):
        dataset = load_preference_data(DataConfig(dataset=write(tmp_path, EXPLICIT_CONVERSATIONS)), thinking)
    said = [r.getMessage() for r in caplog.records if "is not the start of the tokenized prompt" in r.getMessage()]
    assert len(said) == 1 and "in 2 of 2 records" in said[0] and "<think></think>" in said[0]
    assert as_pairs(dataset) == [(p.prompt_ids, p.chosen_ids, p.rejected_ids)
                                 for p in trl.dpo(EXPLICIT_CONVERSATIONS, thinking)]
    assert dataset.prompt_boundary_mismatches == len(EXPLICIT_CONVERSATIONS)
    assert "<think>" not in thinking.decode(dataset.whole(0).prompt_ids)
    # Plain text whose prompt ends in a space merges with the completion's first word: also cut where they agree.
    text = load(write(tmp_path, EXPLICIT_TEXT, "text.jsonl"), tokenizer)
    assert text.prompt_boundary_mismatches >= 1


def test_tools_and_template_arguments_reach_the_template_as_in_trl(tokenizer, trl, tmp_path):
    tooled = with_template(tokenizer, WITH_TOOLS)
    dataset = load(write(tmp_path, WITH_TEMPLATE_EXTRAS), tooled)
    assert as_pairs(dataset) == [(p.prompt_ids, p.chosen_ids, p.rejected_ids)
                                 for p in trl.dpo(WITH_TEMPLATE_EXTRAS, tooled)]
    prompt = tooled.decode(dataset.whole(0).prompt_ids)
    assert '"name": "weather"' in prompt and "Be terse." in prompt


@pytest.mark.parametrize("max_length", [40, 60])
def test_cut_and_dropped_pairs_are_what_trl_trains_on(max_length, tokenizer, trl):
    records = bundled_records()
    dataset = load("builtin:preferences", tokenizer, seq_len=max_length, truncate=True)
    reference = trl.dpo(records, tokenizer, max_length)  # pairs whose prompt fills max_length are dropped here
    assert len(dataset) == len(reference) < len(records)
    assert dataset.policy.dropped_no_target == len(records) - len(reference)
    collate = trl.pair_collator(pad_token_id=tokenizer.pad_token_id, max_length=max_length)

    def rows(items):
        return [{"prompt_ids": i.prompt_ids, "chosen_ids": i.chosen_ids, "rejected_ids": i.rejected_ids} for i in items]

    ours, theirs = collate(rows(dataset)), collate(rows(reference))
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert ours["completion_mask"].tolist() == theirs["completion_mask"].tolist()
    assert all(item.length <= max_length for item in dataset)
    assert dataset.num_target_tokens == int(theirs["completion_mask"].sum())


def test_cut_and_dropped_kto_completions_are_what_trl_trains_on(tokenizer, trl):
    records = bundled_records()
    dataset = load("builtin:preferences", tokenizer, task="kto", seq_len=60, truncate=True)
    reference = trl.kto(records, tokenizer, 60)
    collate = trl.unpaired_collator(pad_token_id=tokenizer.pad_token_id, max_length=60)

    def rows(items):
        return [{"prompt_ids": i.prompt_ids, "completion_ids": i.completion_ids, "label": i.label} for i in items]

    ours, theirs = collate(rows(dataset)), collate(rows(reference))
    assert len(dataset) == len(reference)
    for key in ("input_ids", "completion_mask", "label"):
        assert ours[key].tolist() == theirs[key].tolist()


# -- formats and records -------------------------------------------------------------------------------------------


def test_formats_are_recognised_from_the_fields():
    assert detect_preference_format(EXPLICIT_TEXT[0]) == "preference"
    assert detect_preference_format(IMPLICIT_CONVERSATIONS[0]) == "implicit-preference"
    assert detect_preference_format(UNPAIRED_TEXT[0]) == "unpaired-preference"
    assert detect_preference_format({"messages": []}) is None and detect_preference_format([1]) is None
    question = {"question": "q", "chosen": "a", "rejected": "b"}
    assert detect_preference_format(question, FieldNames(prompt="question")) == "preference"


def test_an_implicit_prompt_is_the_shared_start():
    assert split_implicit_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert split_implicit_prompt("Tea is hot", "Tea is hotter") == ("Tea is ho", "t", "tter")
    chosen = [turn("user", "q"), turn("assistant", "a")]
    assert split_implicit_prompt(chosen, [turn("user", "q"), turn("assistant", "b")]) == (
        [turn("user", "q")], [turn("assistant", "a")], [turn("assistant", "b")])


def test_kto_unpairs_in_trls_batches():
    pairs = [PairRecord(n, "p", f"c{n}", f"r{n}") for n in range(1, UNPAIR_BATCH + 3)]
    order = [(u.completion, u.label) for u in unpair(pairs)]
    first = UNPAIR_BATCH
    assert order[:first] == [(f"c{n}", True) for n in range(1, first + 1)]
    assert order[first : 2 * first] == [(f"r{n}", False) for n in range(1, first + 1)]
    assert order[2 * first :] == [(f"c{first + 1}", True), (f"c{first + 2}", True), (f"r{first + 1}", False),
                                  (f"r{first + 2}", False)]


@pytest.mark.parametrize(("records", "task", "expected"), [
    ([EXPLICIT_TEXT[0], {"prompt": "x", "chosen": "y"}], "dpo", "record 2 has no field 'rejected'"),
    ([EXPLICIT_TEXT[0], EXPLICIT_CONVERSATIONS[0]], "dpo", "record 2 holds lists of turns, record 1 text"),
    ([{"prompt": "q", "chosen": [turn("assistant", "a")], "rejected": "b"}], "dpo", "must all be strings or all lists"),
    ([{"prompt": [turn("robot", "q")], "chosen": [turn("assistant", "a")], "rejected": [turn("assistant", "b")]}],
     "dpo", "turn 1 has unknown role 'robot'"),
    ([{"chosen": "Yes.", "rejected": "No."}], "dpo", "share no start to take as the prompt"),
    ([{"prompt": "q", "completion": "a", "label": "good"}], "kto", "field 'label' must be true"),
    (UNPAIRED_TEXT, "dpo", "use --task kto"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b", "tools": "{not json"}], "dpo", "'tools' is a string that is not"),
    ([{"text": "hello"}], "dpo", "record 1 is not preference data (it has: text)"),
])
def test_bad_records_are_one_line_naming_the_record(records, task, expected, tokenizer, tmp_path):
    with pytest.raises(UsageError, match="prefs.jsonl") as raised:
        load(write(tmp_path, records), tokenizer, task=task)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_plain_text_completions_end_with_eos_once(tokenizer, tmp_path):
    dataset = load(write(tmp_path, EXPLICIT_TEXT), tokenizer)
    eos = tokenizer.eos_token_id
    for index in range(dataset.num_items):
        pair = dataset.whole(index)
        for ids in (pair.chosen_ids, pair.rejected_ids):
            assert ids[-1] == eos and ids.count(eos) == 1
        assert pair.prompt_ids[0] == tokenizer.bos_token_id  # text is tokenized with the special tokens


def test_a_tokenizer_without_a_template_is_refused_unless_one_is_given(tokenizer, tmp_path):
    bare = with_template(tokenizer, None)
    with pytest.raises(UsageError, match="has no chat template"):
        load("builtin:preferences", bare)
    chatml = load("builtin:preferences", bare, chat_template="chatml")
    assert chatml.template_name == "chatml" and "<|im_start|>" in bare.chat_template  # saved with the model


# -- the dataset and its lengths -----------------------------------------------------------------------------------


def test_the_bundled_file_is_small_original_conversational_pairs():
    records = bundled_records()
    assert 40 <= len(records) <= 60
    assert all(detect_preference_format(r) == "preference" and isinstance(r["prompt"], list) for r in records)
    assert all(r["chosen"] != r["rejected"] for r in records)
    note = builtin_path("preferences").with_name("preferences.md").read_text()
    assert "CC0" in note and "written" in note and "memfit" in note


def test_the_dataset_lists_pairs_with_their_lengths(tokenizer):
    dataset = load("builtin:preferences", tokenizer)
    assert len(dataset) == dataset.num_items == dataset.records == 50 and dataset.paired
    pair = dataset[0]
    assert isinstance(pair, PreferencePair) and pair.record == 1
    assert list(dataset.segment_lengths[0]) == [len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)]
    assert pair.length == len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
    assert dataset[-1] == dataset[len(dataset) - 1] and len(list(dataset)) == len(dataset)
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    lengths = dataset.item_lengths
    spread = dataset.length_distribution()
    assert spread.max == lengths.max() and spread.median == int(np.percentile(lengths, 50, method="higher"))
    assert spread.median <= spread.p99 <= spread.max
    # Without --seq-len the length comes from the data: the longest pair, rounded up to a multiple of 64.
    assert dataset.seq_len == -(-spread.max // 64) * 64 and dataset.policy.from_data is not None
    assert dataset.num_target_tokens == int(dataset.segment_lengths[:, 1:].sum())
    assert dataset.num_tokens == int(2 * dataset.segment_lengths[:, 0].sum() + dataset.segment_lengths[:, 1:].sum())
    facts = dataset.data_facts()
    assert facts["format"] == "preference" and facts["samples_kept"] == 50 and facts["item_lengths"]["max"] == spread.max
    assert "50 pairs" in dataset.description and "scored" in dataset.description


def test_what_a_max_length_keeps_cuts_and_drops():
    # prompt, chosen, rejected
    segments = np.array([[4, 3, 2], [6, 5, 1], [10, 2, 2], [3, 1, 1]])
    policy = apply_preference_policy(segments, 8, truncate=True)
    assert policy.kept.tolist() == [0, 1, 3] and policy.truncated == 1 and policy.dropped_no_target == 1
    assert policy.lengths.tolist() == [7, 8, 4] and policy.targets.tolist() == [5, 3, 2]
    assert policy.target_tokens_lost == (5 + 1 - 3) + 4
    dropped = apply_preference_policy(segments, 8, truncate=False)
    assert dropped.kept.tolist() == [0, 3] and dropped.dropped_long == 2 and dropped.target_tokens_lost == 6 + 4
    from_data = apply_preference_policy(segments, None, truncate=False)
    assert from_data.seq_len == 64 and len(from_data.kept) == 4


def test_cost_at_a_length_counts_whole_cut_and_dropped_pairs(tokenizer):
    dataset = load("builtin:preferences", tokenizer)
    prompts, lengths = dataset.segment_lengths[:, 0], dataset.item_lengths
    limit = int(np.median(lengths))
    cost = dataset.cost_at(limit)
    assert cost.whole == int((lengths <= limit).sum()) and cost.dropped == int((prompts >= limit).sum())
    assert cost.whole + cost.cut + cost.dropped == dataset.num_items and cost.scored_tokens_lost > 0
    assert dataset.cost_at(int(lengths.max())).as_dict() == {"max_length": int(lengths.max()), "whole": 50, "cut": 0,
                                                              "dropped": 0, "scored_tokens_lost": 0}


def test_a_length_that_drops_too_many_pairs_is_refused_unless_allowed(tokenizer):
    with pytest.raises(UsageError, match="would drop .* pass --seq-len") as raised:
        load("builtin:preferences", tokenizer, seq_len=128)
    assert "\n" not in str(raised.value)
    allowed = load("builtin:preferences", tokenizer, seq_len=128, allow_drop=True)
    assert 0 < len(allowed) < 50 and all(item.length <= 128 for item in allowed)
    with pytest.raises(UsageError, match="fewer than one effective batch"):
        load_preference_data(DataConfig(dataset="builtin:preferences"), tokenizer, min_samples=51, say=False)
    with pytest.raises(UsageError, match="too long: the model handles at most 100 positions"):
        load_preference_data(DataConfig(dataset="builtin:preferences", seq_len=128), tokenizer, max_positions=100)


def test_what_the_length_did_is_said_in_one_line_each(tokenizer, caplog):
    with caplog.at_level("INFO"):
        load_preference_data(DataConfig(dataset="builtin:preferences", seq_len=60, truncate=True), tokenizer)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit:")]
    assert any("--truncate:" in line and "pairs of builtin:preferences cut" in line for line in said)
    assert any("the prompt alone fills 60 tokens" in line for line in said)


def test_preference_tasks():
    assert PREFERENCE_TASKS == ("dpo", "simpo", "orpo", "kto")


# -- what `memfit data --task dpo` shows ---------------------------------------------------------------------------


def test_the_report_shows_prompt_and_marked_completions_decoded_from_the_tokens(tokenizer):
    dataset = load("builtin:preferences", tokenizer)
    report = preference_report(dataset, tokenizer, show=2)
    assert json.loads(json.dumps(report)) == report  # the --json object
    first = report["shown"][0]
    assert first["prompt"] == tokenizer.decode(dataset[0].prompt_ids)
    assert [c["name"] for c in first["completions"]] == ["chosen", "rejected"]
    assert first["completions"][0]["ids"] == dataset[0].chosen_ids
    assert report["lengths"]["item"]["max"] == dataset.length_distribution().max
    text = describe_preference_data(report)
    record = bundled_records()[0]
    assert record["prompt"][-1]["content"] in text
    assert f"[[{record['chosen'][0]['content']}<|im_end|>\n]]" in text
    assert f"[[{record['rejected'][0]['content']}<|im_end|>\n]]" in text
    assert "pair lengths" in text and "median" in text and "p99" in text and "scored tokens" in text
    assert "--- pair 2 (record 2)" in text and "--- pair 3" not in text
    assert "\033[" in describe_preference_data(report, color=True)


def test_the_report_of_kto_data_shows_labels_and_cuts(tokenizer):
    dataset = load("builtin:preferences", tokenizer, task="kto", seq_len=60, truncate=True)
    report = preference_report(dataset, tokenizer, show=1)
    text = describe_preference_data(report)
    assert "completion 1 (record" in text and ("desirable" in text) and "labels:" in text
    assert "--truncate:" in text and "the prompt alone fills 60 tokens" in text
    assert report["cost_at_seq_len"]["dropped"] == dataset.policy.dropped_no_target


def test_a_cut_pair_says_so(tokenizer):
    dataset = load("builtin:preferences", tokenizer, seq_len=90, truncate=True)
    cut = [dataset[i].length < dataset.whole(int(dataset.policy.kept[i])).length for i in range(len(dataset))]
    assert any(cut) and not all(cut)
    shown = preference_report(dataset, tokenizer, show=len(dataset))["shown"]
    assert [item["cut"] for item in shown] == cut
    first = cut.index(True)
    assert "cut to --seq-len 90" in describe_preference_data(preference_report(dataset, tokenizer, show=first + 1))


def test_parquet_records_read_as_their_jsonl(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    records = EXPLICIT_CONVERSATIONS + [{"prompt": [turn("user", "Hi"), {"role": "user", "content": "there", "name": "x"}],
                                         "chosen": [turn("assistant", "Hello.")], "rejected": [turn("assistant", "Go.")]}]
    path = tmp_path / "prefs.parquet"
    pq.write_table(pyarrow.Table.from_pylist(records), path)  # turns without `name` get name: null
    assert as_pairs(load(str(path), tokenizer)) == as_pairs(load(write(tmp_path, records), tokenizer))


def test_a_supervised_dataset_format_is_refused(tokenizer):
    with pytest.raises(UsageError, match="--dataset-format messages is a supervised format"):
        load("builtin:preferences", tokenizer, dataset_format="messages")

"""Prompt datasets for --task grpo: the prompt tokens are those TRL 1.16's GRPOTrainer generates from
(`_tokenize_prompts` on the same records and tokenizer, plain and conversational, the bundled file included); other
columns reach the items; --max-prompt-length keeps the last tokens; a record without a prompt is refused naming the
fields found. The tokenizer is a byte-level BPE trained here that adds a BOS to text, with a ChatML template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from memfit.config_sections import DataConfig
from memfit.data.prompts import PromptTokenizer, load_prompts
from memfit.data.records import builtin_path
from memfit.errors import UsageError

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = [{"prompt": "What is 2 + 3?", "answer": "5", "level": 1},
         {"prompt": "Add 10 and 7, then say the sum.", "answer": "17", "level": 2}]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(builtin_path("prompts").read_text().splitlines(), trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    built = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    built.chat_template = CHATML_WITH_BOS
    return built


def write(tmp_path, records: list[dict]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def trl_prompt_ids(tokenizer, prompts: list) -> list[list[int]]:
    """TRL's own `GRPOTrainer._tokenize_prompts` on a namespace with the attributes it reads."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    owner = SimpleNamespace(_is_vlm=False, environment_factories=None, processing_class=tokenizer, tools=None,
                            chat_template=None, chat_template_kwargs={})
    prompt_ids, _, _ = grpo.GRPOTrainer._tokenize_prompts(owner, prompts)
    return [list(ids) for ids in prompt_ids]


def test_plain_prompts_are_trls_tokens_and_keep_their_columns(tokenizer, tmp_path):
    items = load_prompts(DataConfig(dataset=write(tmp_path, PLAIN)), tokenizer, say=False)
    assert [item.prompt_ids for item in items] == trl_prompt_ids(tokenizer, [r["prompt"] for r in PLAIN])
    assert items[0].prompt_ids[0] == tokenizer.bos_token_id
    assert [item.columns for item in items] == [{"answer": "5", "level": 1}, {"answer": "17", "level": 2}]


def test_the_bundled_conversational_prompts_are_trls_tokens(tokenizer):
    records = [json.loads(line) for line in builtin_path("prompts").read_text().splitlines()]
    items = load_prompts(DataConfig(dataset="builtin:prompts"), tokenizer, say=False)
    assert len(items) == len(records) >= 40
    assert [item.prompt_ids for item in items] == trl_prompt_ids(tokenizer, [r["prompt"] for r in records])
    assert tokenizer.decode(items[0].prompt_ids).endswith("<|im_start|>assistant\n")
    assert all(item.columns.keys() == {"answer"} for item in items)


def test_max_prompt_length_keeps_the_last_tokens(tokenizer):
    whole = PromptTokenizer(tokenizer)(PLAIN[1]["prompt"])
    cut = PromptTokenizer(tokenizer, max_prompt_length=4)
    assert cut(PLAIN[1]["prompt"]) == whole[-4:] and cut.truncated == 1
    assert cut("2") == PromptTokenizer(tokenizer)("2") and cut.truncated == 1


def test_a_record_without_a_prompt_names_the_fields_found(tokenizer, tmp_path):
    dataset = write(tmp_path, [{"question": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(UsageError, match=r"no 'prompt' field \(found: question, answer\)"):
        load_prompts(DataConfig(dataset=dataset), tokenizer, say=False)


def test_the_view_shows_prompts_as_generation_reads_them_and_the_reward_columns(tokenizer, tmp_path):
    from memfit.data.prompts import describe_prompt_data, prompt_report

    items = load_prompts(DataConfig(dataset=write(tmp_path, PLAIN)), tokenizer, max_prompt_length=6, say=False)
    report = prompt_report(items, tokenizer, dataset="prompts.jsonl", max_prompt_length=6, show=1)
    assert report["reward_columns"] == ["answer", "level"] and report["cut"] == 2
    assert report["prompt_lengths"]["max"] == 6 and len(report["shown"]) == 1
    text = describe_prompt_data(report)
    assert "columns passed to the reward functions: answer, level" in text
    assert tokenizer.decode(items[0].prompt_ids) in text and "2 prompts reach it" in text

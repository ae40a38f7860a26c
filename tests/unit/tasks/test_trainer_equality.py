"""memfit equals the Hugging Face Trainer on the same tiny encoder, data and settings.

SGD without momentum, clipping or warmup, a constant rate, no dropout; the Trainer reads the samples
in memfit's order (memfit shuffles by --seed; the Trainer's sampler is made sequential) and pads each
batch to its longest sample as memfit does. After a few steps the weights must agree.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_NO_CLIPPING, largest_update, scaled_gradients
from memfit.config_loading import load_config
from memfit.data import BatchSchedule
from memfit.data.tables import label_spec, load_table
from memfit.train.loop import train

STEPS, BATCH, SEED, LR = 3, 8, 0, 0.5


def _memfit(model_dir, data, out, task, fields):
    config = load_config(overrides=dict(model=str(model_dir), dataset=str(data), task=task, label_fields=fields,
                                        seq_len=64, batch_size=BATCH, max_steps=STEPS, seed=SEED, lr=LR,
                                        output_dir=str(out), report=False, **SGD_NO_CLIPPING))
    return load_file(str(train(config).final_dir / "model.safetensors"))


def _trainer(model_dir, data, out, task, fields):
    import transformers
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kind = {"sequence-classification": "class", "regression": "number"}[task]
    spec = label_spec(str(data), kind, [fields], "sequence", None, None)
    table = load_table(str(data), spec, tokenizer, sequence_field="sequence", seq_len=64, truncate=False)
    schedule = BatchSchedule(len(table), BATCH, SEED)
    order = [i for step in range(STEPS) for i in schedule.batch_indices(step)]
    rows = [{"input_ids": table[i]["input_ids"].tolist(), "labels": table[i]["labels"].tolist()} for i in order]

    torch.manual_seed(SEED)  # memfit seeds the new head the same way
    head = {"problem_type": "regression", "num_labels": 1} if kind == "number" else {
        "num_labels": spec.num_labels, "problem_type": "single_label_classification"}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, **head)

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    arguments = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=SEED, dataloader_num_workers=0,
    )
    InOrder(model=model, args=arguments, train_dataset=rows,
            data_collator=DataCollatorWithPadding(tokenizer)).train()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(("task", "fields"), [("sequence-classification", "label"), ("regression", "value")])
def test_same_weights_as_the_trainer(encoder_dirs, dna_csv, tmp_path, task, fields):
    ours = _memfit(encoder_dirs["bert"], dna_csv, tmp_path / "memfit", task, fields)
    theirs = _trainer(encoder_dirs["bert"], dna_csv, tmp_path / "trainer", task, fields)
    initial = load_file(str(encoder_dirs["bert"] / "model.safetensors"))
    assert largest_update({k: v for k, v in initial.items() if k in ours}, ours) > 2e-3  # 200x the tolerance
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_trainer_check_fails_on_a_2x_gradient_error(encoder_dirs, dna_csv, tmp_path):
    with scaled_gradients(2.0):
        ours = _memfit(encoder_dirs["bert"], dna_csv, tmp_path / "memfit", "sequence-classification", "label")
    theirs = _trainer(encoder_dirs["bert"], dna_csv, tmp_path / "trainer", "sequence-classification", "label")
    with pytest.raises(AssertionError):
        for name, tensor in ours.items():
            torch.testing.assert_close(theirs[name], tensor, atol=1e-5, rtol=0, msg=name)

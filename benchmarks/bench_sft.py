"""memfit's default supervised fine-tune against TRL's SFTTrainer: target tokens/s and peak memory.

    python benchmarks/bench_sft.py                      # 4-block Llama (width 256), seq 512, CPU
    python benchmarks/bench_sft.py --steps 10 --seq-len 1024

The same randomly initialised model (saved once with a fixed seed, read by both), the same
conversations (memfit's bundled chat set, rendered with the same ChatML template, those longer
than --seq-len left out so neither tool drops or cuts any), fp32, SDPA attention, one
process per run, torch on one thread (tokens per CPU second stay comparable on a shared machine):

- memfit, its defaults: `--packing samples` (whole conversations packed by best-fit decreasing,
  attention and positions restarting at each), loss on the assistant turns;
- memfit `--packing off` (one conversation per row, padded), for reference;
- TRL's defaults (`SFTConfig` with only the device, the length, the batch and the steps
  set): one conversation per row padded to the batch's longest, loss on every token,
  gradient checkpointing on (TRL's default);
- TRL with `packing=True` (its best-fit decreasing, padding-free rows with position_ids);
- the same with `assistant_only_loss=True`: loss on the answers, as memfit's default.

Same effective batch: TRL's defaults take 8 conversations a step (`--batch`); the packed
runs take the number of windows those conversations fill (their mean length x 8 / the
packing efficiency at --seq-len), so every run trains on about the same tokens a step.
Reported per run, over the steps after the first two: target tokens (those that carry
loss) per second of wall time and per CPU second, all tokens per second, and the
process's peak RSS from the first step on (VmHWM reset when training starts: model
loading is out of it for all runs). Ratios are to TRL's defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit_result, machine_description, run_worker  # noqa: E402

# ChatML as memfit ships it (data/templates/chatml.jinja), with the {% generation %} markers TRL's
# assistant_only_loss needs around each answer and its end of turn; the rendered text is the same.
CHATML_WITH_GENERATION_MARKERS = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=257, tie_word_embeddings=True)


def prepare(directory: Path, seq_len: int) -> tuple[Path, Path, list[int]]:
    """The saved model (byte tokenizer with ChatML) and the conversations that fit in seq_len."""
    import importlib.resources

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.models.tiny import byte_tokenizer

    model_dir = directory / "model"
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, max_position_embeddings=max(2048, seq_len), bos_token_id=256, eos_token_id=256,
                         pad_token_id=256)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML_WITH_GENERATION_MARKERS
    tokenizer.save_pretrained(model_dir)
    chat = importlib.resources.files("memfit.data") / "chat" / "chat.jsonl"
    kept, lengths = [], []
    for line in chat.read_text().splitlines():
        record = json.loads(line)
        length = len(tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"])
        if length <= seq_len:
            kept.append(line)
            lengths.append(length)
    data = directory / "chat.jsonl"
    data.write_text("\n".join(kept) + "\n")
    return model_dir, data, lengths


class StepClock:
    """Wall and CPU time from the end of one step to the end of the next, and the memory peak since the start."""

    def __init__(self) -> None:
        from memfit.memory.stats import reset_process_peak

        self.wall, self.cpu = [], []
        reset_process_peak()
        self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self._last = now

    @staticmethod
    def peak_rss() -> int:
        from memfit.memory.stats import process_peak_rss_bytes

        return int(process_peak_rss_bytes() or 0)


def summarize(name: str, clock: StepClock, tokens: list[int], targets: list[int], samples: list[int], warmup: int,
              notes: str) -> dict:
    measured = slice(warmup, None)
    wall, cpu = sum(clock.wall[measured]), sum(clock.cpu[measured])
    return {
        "name": name, "notes": notes, "steps": len(clock.wall),
        "target_tokens_per_step": sum(targets[measured]) / max(1, len(targets[measured])),
        "tokens_per_step": sum(tokens[measured]) / max(1, len(tokens[measured])),
        "samples_per_step": sum(samples[measured]) / max(1, len(samples[measured])),
        "target_tokens_per_second": sum(targets[measured]) / wall,
        "target_tokens_per_cpu_second": sum(targets[measured]) / cpu,
        "tokens_per_second": sum(tokens[measured]) / wall,
        "tokens_per_cpu_second": sum(tokens[measured]) / cpu,
        "samples_per_cpu_second": sum(samples[measured]) / cpu,
        "peak_rss_bytes": StepClock.peak_rss(),
    }


def memfit_worker(spec: dict) -> dict:
    from memfit.config_loading import load_config
    from memfit.train.setup import build_session
    from memfit.train.step import StepRunner

    config = load_config(overrides=dict(
        model=spec["model"], dataset=spec["data"], seq_len=spec["seq_len"], batch_size=spec["rows"],
        max_steps=spec["steps"], packing=spec["packing"], precision="fp32", output_dir=spec["out"],
    ))
    session = build_session(config)
    runner = StepRunner.from_session(session)
    dataset = session.dataset
    tokens, targets, samples = [], [], []
    clock = StepClock()
    for step in range(spec["steps"]):
        indices = session.schedule.batch_indices(step)
        result = runner.run([dataset[i] for i in indices])
        clock.tick()
        tokens.append(result.input_tokens)
        targets.append(result.target_tokens)
        rows = getattr(dataset, "rows", None)
        samples.append(sum(len(rows[i]) for i in indices) if rows is not None else len(indices))
    facts = getattr(dataset, "facts", None)
    notes = f"packing {json.dumps(facts()) if callable(facts) else spec['packing']}; checkpointing {session.checkpointing}"
    return summarize(spec["name"], clock, tokens, targets, samples, spec["warmup"], notes)


def trl_worker(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    records = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="sdpa", dtype=torch.float32)
    args = SFTConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, max_length=spec["seq_len"], packing=spec["packing"],
        per_device_train_batch_size=spec["rows"], gradient_accumulation_steps=1, max_steps=spec["steps"],
        report_to=[], save_strategy="no", logging_steps=10_000, seed=0,
        assistant_only_loss=spec.get("assistant_only_loss", False),
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    tokens, targets, samples = [], [], []
    collate = trainer.data_collator

    def counting_collator(features):
        batch = collate(features)
        labels = batch["labels"]
        if "attention_mask" in batch:
            tokens.append(int(batch["attention_mask"].sum()))
            samples.append(int(labels.shape[0]))
        else:  # padding-free rows: one sample starts at each position 0
            tokens.append(int(batch["input_ids"].numel()))
            samples.append(int((batch["position_ids"] == 0).sum()))
        targets.append(int((labels[..., 1:] != -100).sum()))
        return batch

    trainer.data_collator = counting_collator
    holder: dict = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            holder["clock"] = StepClock()

        def on_step_end(self, *args, **kwargs):
            holder["clock"].tick()

    trainer.add_callback(Clock())
    trainer.train()
    notes = (f"packing={args.packing} padding_free={args.padding_free} gradient_checkpointing={args.gradient_checkpointing}"
             f" assistant_only_loss={args.assistant_only_loss}")
    return summarize(spec["name"], holder["clock"], tokens, targets, samples, spec["warmup"], notes)


def worker(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    emit_result(memfit_worker(spec) if spec["tool"] == "memfit" else trl_worker(spec))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="conversations a step of TRL's defaults")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    import importlib.util

    from memfit.data.packing import best_fit_decreasing

    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"bench_sft needs {' and '.join(missing)}: pip install 'memfit[bench]'")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model_dir, data, lengths = prepare(root, args.seq_len)
        windows = len(best_fit_decreasing(lengths, args.seq_len))
        rows = max(1, round(args.batch * windows / len(lengths)))
        common = dict(model=str(model_dir), data=str(data), seq_len=args.seq_len, steps=args.steps, warmup=args.warmup)
        runs = [
            dict(name="TRL defaults", tool="trl", packing=False, rows=args.batch),
            dict(name="TRL packing=True", tool="trl", packing=True, rows=rows),
            dict(name="TRL packing=True, assistant_only_loss=True", tool="trl", packing=True, rows=rows,
                 assistant_only_loss=True),
            dict(name="memfit defaults (--packing samples)", tool="memfit", packing="auto", rows=rows),
            dict(name="memfit --packing off", tool="memfit", packing="off", rows=args.batch),
        ]
        results = [run_worker(__file__, {**common, **run, "out": str(root / f"out{i}")}, timeout=1800)
                   for i, run in enumerate(runs)]
    base = results[0]
    print(f"machine: {machine_description('cpu')}")
    print(f"{len(lengths)} conversations of <= {args.seq_len} tokens (mean {sum(lengths) / len(lengths):.0f});"
          f" packed runs: {rows} windows a step; steps {args.steps}, first {args.warmup} not timed")
    header = ("| run | conversations/step | target tokens/step | target tok/s | target tok/CPU s | tokens/CPU s |"
              " conversations/CPU s | peak RSS MiB | vs TRL defaults: target tok/CPU s, conversations/CPU s, peak RSS |")
    print(header)
    print("|" + "---|" * 9)
    for r in results:
        print(f"| {r['name']} | {r['samples_per_step']:.1f} | {r['target_tokens_per_step']:.0f} |"
              f" {r['target_tokens_per_second']:.0f} | {r['target_tokens_per_cpu_second']:.0f} |"
              f" {r['tokens_per_cpu_second']:.0f} | {r['samples_per_cpu_second']:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} |"
              f" {r['target_tokens_per_cpu_second'] / base['target_tokens_per_cpu_second']:.2f}x,"
              f" {r['samples_per_cpu_second'] / base['samples_per_cpu_second']:.2f}x,"
              f" {r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}x |")
    for r in results:
        print(f"- {r['name']}: {r['notes']}")


if __name__ == "__main__":
    main()

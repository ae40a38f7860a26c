"""`memfit presets [models|gpus]`: what the offline tables know."""

from __future__ import annotations

from memfit.cli.help_text import CommandHelp, answer_help
from memfit.errors import UsageError

HELP = CommandHelp(
    "presets", "memfit presets [models|gpus]",
    "List the model and GPU presets usable offline with --model / --gpu (estimate, plan, and train with "
    "--memory-budget or --gpu): a model's shape and Hugging Face id, a GPU's memory, bf16 support, 16-bit TFLOPS and "
    "host link.",
    train_flags=False,
    arguments=(("models", "Only the model presets (--model NAME, or preset:NAME for random weights of its shape)."),
               ("gpus", "Only the GPU presets (--gpu NAME)."),
               ("(neither)", "Both tables.")),
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    which = argv[0] if argv else "all"
    if which not in ("all", "models", "gpus") or len(argv) > 1:
        raise UsageError(f"memfit presets takes 'models' or 'gpus', got {' '.join(argv)!r}")
    if which in ("all", "models"):
        print(models_table())
    if which == "all":
        print()
    if which in ("all", "gpus"):
        print(gpus_table())
    return 0


def models_table() -> str:
    from memfit.models.presets import list_model_presets, parameter_count

    lines = [f"{'model':<16} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>6} {'kv':>4} {'vocab':>7}  hugging face id"]
    for p in list_model_presets():
        count = parameter_count(p.to_hf_config())
        lines.append(
            f"{p.name:<16} {count / 1e9:>7.2f}B {p.num_layers:>6} {p.hidden_size:>6} {p.num_heads:>6} "
            f"{p.num_kv_heads:>4} {p.vocab_size:>7}  {p.hf_id}"
        )
    return "\n".join(lines)


def gpus_table() -> str:
    from memfit.gpus import list_gpus

    lines = [f"{'gpu':<12} {'memory':>10} {'bf16':>5} {'TFLOPS 16-bit':>14} {'host GB/s':>10}"]
    for g in list_gpus():
        lines.append(
            f"{g.name:<12} {g.memory_bytes / 1024**3:>6.2f} GiB {'yes' if g.bf16 else 'no':>5} {g.peak_tflops:>14.0f} {g.host_link_gbps:>10.0f}"
        )
    return "\n".join(lines)

"""`memfit estimate`: will it fit? The predicted peak memory of a training step, part by part."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.units import format_bytes

SUMMARY = (
    "Predict the peak memory of one training step (no weights loaded) and whether it fits --gpu / --memory-budget.\n"
    "Without --seq-len it estimates 256 tokens a sample, or with --dataset the length memfit train takes from the data."
)


@dataclass
class EstimateOptions:
    method: str = field(default="analytical", metadata={"choices": ("analytical", "traced")})
    """analytical (closed forms, instant) or traced (one step on fake tensors, seconds)."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""
    world_size: int = 1
    """Devices the run is spread over; with --sharding fsdp or --zero-stage they divide the state."""
    offload: bool = False
    """Keep the optimizer state on the CPU (same as --optimizer-offload)."""


HELP = CommandHelp(
    "estimate", "memfit estimate [--config FILE.yaml] [--FLAG VALUE ...]", SUMMARY, (EstimateOptions,),
    first=("config", "model", "seq_len", "batch_size", "lora_r", "quantize", "precision", "gradient_checkpointing",
           "gpu", "memory_budget"),
    first_title="the training flags it reads most (it takes every memfit train flag):",
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    import memfit.train.traced  # noqa: F401  (registers the step --method traced runs)
    from memfit.prediction.estimator import estimate

    config, extras = parse_command_line(argv, extras=[EstimateOptions])
    from memfit.models.model_names import check_model_flags

    check_model_flags(config, weights=False)  # no such model: one line, before anything is read
    options: EstimateOptions = extras[EstimateOptions]
    if _takes_length_from_data(config):
        from memfit.cli.data import describe_plan_basis, plan_from_dataset
        from memfit.cli.output import stdout_to_stderr

        with stdout_to_stderr(options.json):  # the length memfit train takes from the data, said on stderr
            config, basis = plan_from_dataset(config)
        print(describe_plan_basis(config.data.dataset, basis).replace("planned at", "estimated at"), file=sys.stderr)
    if options.offload:
        config = config.replace(optimizer_offload=True)
    result = estimate(config, method=options.method, world_size=options.world_size)
    if result.details.get("rl_step"):  # --task grpo: the step's predicted time, generation apart from training
        result.details["rl_step"]["predicted_seconds"] = rl_step_time(config, result)
    if options.json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return 0
    print(render(result))
    if "context_parallel" in result.details:  # --context-parallel N: the figures are one rank's of the split
        from memfit.prediction.context_parallel import describe_split

        print(describe_split(result.details))
    return 0


def _takes_length_from_data(config) -> bool:
    """No --seq-len and a --dataset of whole samples (conversations, instructions): memfit train takes the length
    from the data, so the estimate does too (plain text and tables: 256)."""
    if config.data.seq_len is not None or not config.data.dataset or "dataset" not in (config.user_set or ()):
        return False
    from memfit.data.samples import plain_text

    return config.task.task == "causal-lm" and not plain_text(config.data)


def rl_step_time(config, result) -> dict[str, float | str]:
    """A --task grpo step's predicted seconds by phase (prediction/rl_speed.py), on --gpu's preset, else on this
    machine's CPU as calibrated here; each rank's share of the step under --world-size."""
    from memfit.gpus import get_gpu
    from memfit.models.presets import resolve_model_config
    from memfit.prediction.speed_model import rl_step_seconds
    from memfit.resolution.resolve import resolve

    hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    gpu = get_gpu(config.memory.gpu) if config.memory.gpu else None
    device = "cuda" if gpu is not None else "cpu"
    run = resolve(config.with_seq_len(), hf_config, device)
    per_rank = max(1, config.training.gradient_accumulation_steps)
    changes = {"batch_size": config.training.batch_size, "gradient_accumulation_steps": per_rank,
               "gradient_checkpointing": next((m for m in ("full", "selective")
                                               if str(run.checkpointing).startswith(m)), "off"),
               "lora_r": run.lora_r, "quantize": run.quantize, "optimizer": run.optimizer,
               "precision": config.memory.precision}
    split = rl_step_seconds(changes, config.with_seq_len(), result, gpu, hf_config, device=device)
    return {"generation": split.generation, "scoring": split.scoring, "training": split.training,
            "step": split.total, "device": gpu.name if gpu is not None
            else "this CPU (a nominal rate times what this machine measured, if anything: read the split; or give --gpu)"}


def describe_rl_time(seconds: dict[str, float | str]) -> str:
    """The line of a GRPO step's predicted time: the step, then generation, scoring and training."""
    step = float(seconds["step"]) or 1e-12
    parts = [f"{name} {float(seconds[name]):.3g} s ({100 * float(seconds[name]) / step:.0f}%)"
             for name in ("generation", "scoring", "training") if float(seconds[name]) or name != "scoring"]
    return f"  predicted step time on {seconds['device']}: {float(seconds['step']):.3g} s = " + ", ".join(parts)


def _count(n: int) -> str:
    """A parameter count a person reads: 20.9B, 1.3M, 35.0K (a tiny model is not "0.00B")."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def render(result) -> str:
    """The estimate as a table: bytes in GiB and % of the peak, then the verdict."""
    peak = max(result.peak_bytes, 1)
    d = result.details
    lines = [
        f"memfit estimate: {result.model} ({_count(d['parameter_count'])} parameters"
        + (f", {_count(d['parameters_active'])} active per token" if d.get("parameters_active", d["parameter_count"])
           != d["parameter_count"] else "")
        + f", {_count(d['trainable_parameter_count'])} trainable), {result.method} method",
        f"  device {d['device']}, precision {d['precision']}, attention {d['attention']}, "
        f"checkpointing {d['checkpointing']}, loss chunk {d['loss_chunk_size'] or 'off'}, "
        f"sharding {d['sharding']} x{d['world_size']}",
        "",
        f"  {'at the peak (' + str(d.get('peak_phase', '')) + ')':<28} {'GiB':>10} {'%':>7}",
    ]
    for name, value in result.breakdown.items():
        lines.append(f"  {name.replace('_', ' '):<28} {value / 1024**3:>10.3f} {100 * value / peak:>6.1f}%")
    lines.append(f"  {'peak':<28} {result.peak_bytes / 1024**3:>10.3f}  (+-{100 * result.error_band:.0f}%)")
    lines.append(f"  activations per layer: {format_bytes(result.per_layer_activation_bytes)}")
    if result.host_bytes:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in result.host_breakdown.items()
                          if value)
        lines.append(f"  host memory (not in the peak): {format_bytes(result.host_bytes)} ({parts})")
        if result.host_available_bytes is not None:
            verdict = "enough" if result.host_fits else "NOT enough"
            lines.append(f"  this machine has {format_bytes(result.host_available_bytes)} available: {verdict}")
    if d.get("load_peak_bytes"):
        staged = d.get("staged_load", "nothing")
        how = (f"staged: {staged} in host memory until each takes its final form" if staged != "nothing"
               else "loaded on the device as it is")
        lines.append(f"  load (to the first step): {format_bytes(d['load_peak_bytes'])} device"
                     f"{', ' + format_bytes(result.load_host_bytes) + ' host' if result.load_host_bytes else ''}"
                     f" ({how}){'; the load is the peak' if d.get('peak_phase') == 'load' else ''}")
        if result.load_host_bytes > result.host_bytes and result.host_available_bytes is not None:
            verdict = "enough" if result.host_fits else "NOT enough"
            lines.append(f"  this machine has {format_bytes(result.host_available_bytes)} available for the load:"
                         f" {verdict}")
    if d.get("rl_step"):
        rl = d["rl_step"]
        lines.append(f"  grpo step, {rl['row_tokens']} tokens a completion: generation {format_bytes(rl['generation_bytes'])}"
                     f" (key-value cache {format_bytes(rl['kv_cache_bytes'])} for {rl['completions_generated_at_once']}"
                     f" completions at once), training {format_bytes(rl['training_bytes'])}"
                     f"{' (with the reference copy ' + format_bytes(rl['reference_copy_bytes']) + ')' if rl['reference_copy_bytes'] else ''}"
                     f"{', scoring ' + format_bytes(rl['scoring_bytes']) if rl.get('scoring_bytes') else ''};"
                     f" the peak is {rl['peak_phase']}'s")
        if rl.get("predicted_seconds"):
            lines.append(describe_rl_time(rl["predicted_seconds"]))
    for name in d.get("not_traced", []):
        lines.append(f"  not traced: {name} (the traced step runs without it: an upper bound; see --method analytical)")
    if result.budget_bytes is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        lines.append(
            f"  {verdict} in {format_bytes(result.budget_bytes)}: headroom {format_bytes(result.headroom_bytes)}"
            + ("" if result.fits else "  (try: memfit plan with the same flags)")
        )
    return "\n".join(lines)

"""Shared pieces of the benchmark scripts.

- `llama_config` / `save_model`: a Llama-shaped model of a named size, saved with the
  byte-level tokenizer so that `--model DIR` loads it through memfit's real loader and
  every run of a benchmark starts from the same weights.
- `run_worker` / `emit_result`: each measured configuration runs in a fresh Python
  process, so that one run's peak memory never hides inside another's.
- `PeakWatch`: the peak memory of a process (CPU: VmHWM; CUDA: max allocated) across
  the per-step peak resets that memfit's loop does.
- `timed_steps`: a built session's optimizer steps as its loop runs them, each timed to the
  end of its device work, with the allocator's and the process's peaks over them.
- `machine_description`, `markdown_table`, `write_section`: the report.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH_RESULT "

# Llama shapes by name. "20m": 6 blocks of width 384 (6 heads, no grouping), a 32000-token
# vocabulary like Llama 2's, embeddings tied to the output head: 22.9M parameters, of which
# 12.3M in the embedding. "quick": a toy for smoke runs.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "20m": {
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
    },
    "quick": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}


def llama_config(shape: str, max_positions: int = 2048):
    """A `LlamaConfig` of one of MODEL_SHAPES. Token ids come from the byte tokenizer (< 257)."""
    from transformers import LlamaConfig

    eos = 256  # the byte tokenizer's end-of-text id
    return LlamaConfig(
        **MODEL_SHAPES[shape],
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def save_model(directory: str | Path, shape: str, seed: int = 0) -> int:
    """Build the model `shape` with a fixed seed, save it and the byte tokenizer; return its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    from memfit.models.tiny import byte_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(shape))
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


class PeakWatch:
    """Peak memory of this process from its start, kept across memfit's per-step resets.

    memfit's loop resets the peak at the start of every step (so that each metrics line
    holds that step's peak); `before_reset` reads the peak just before, so the maximum
    of those readings and the last one is the peak of the whole process.
    """

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.peak = 0

    def read(self) -> int:
        if self.device_type == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated())
        from memfit.memory.stats import process_peak_rss_bytes

        return int(process_peak_rss_bytes() or 0)

    def before_reset(self) -> None:
        self.peak = max(self.peak, self.read())

    def total(self) -> int:
        return max(self.peak, self.read())


def tracked_and_estimated(config) -> tuple[int, int, Any]:
    """A short `memfit profile` of `config` against its analytical estimate.

    Returns the steady step's tracked device and host peaks (live tensor bytes) and the
    estimate (`memfit.prediction.estimator.Estimate`).
    """
    from memfit.prediction.estimator import estimate
    from memfit.train.profiling import profile_run

    report, _ = profile_run(config)
    data = report.to_dict()
    return data["peak_bytes"], data.get("host_peak_bytes", 0), estimate(config)


@contextlib.contextmanager
def instrumented_loop(loop: Any, watch: PeakWatch, on_record: Any) -> Iterator[None]:
    """memfit's training loop (the module `memfit.train.loop`) instrumented while the block runs: the peak is read
    before each of the loop's per-step resets, and `on_record(record)` sees every metrics line before it is written.

    Instrumentation only: the loop runs as it would. On leaving, the loop is as it was (a --quick benchmark runs
    several workers in one process).
    """
    original_reset, original_make_logger = loop.reset_peaks, loop.make_logger

    def reset_peaks(device):
        watch.before_reset()
        original_reset(device)

    class ObservedLogger:
        def __init__(self, inner):
            self.inner = inner

        def log(self, record: dict[str, Any]) -> None:
            on_record(record)
            self.inner.log(record)

        def close(self) -> None:
            self.inner.close()

    loop.reset_peaks = reset_peaks
    loop.make_logger = lambda session: ObservedLogger(original_make_logger(session))
    try:
        yield
    finally:
        loop.reset_peaks, loop.make_logger = original_reset, original_make_logger


def current_rss_bytes() -> int:
    from memfit.memory.stats import process_rss_bytes

    return int(process_rss_bytes() or 0)


def synchronize(device_type: str) -> None:
    """Wait for queued GPU work, so that a step's time is the step's."""
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_steps(session, steps: int, context: Any = None) -> dict[str, Any]:
    """Train `steps` optimizer steps of a built memfit session as its loop does, timing each one.

    The samples of each step come from the session's schedule through its task, and the next
    step's are handed over so the input pipeline runs ahead (memfit.train.loop). Each step is
    timed from the end of the previous one to the end of its own queued device work, so a
    step's seconds hold everything it costs. `context` (e.g. an activation-offload context)
    is entered around all the steps. Returns the seconds, the `StepResult`s and the sample
    indices of every step, the CUDA allocator's peak over the steps (None on a CPU) and the
    process's peak RSS over them.
    """
    import contextlib
    import time

    import torch

    from memfit.memory.stats import process_peak_rss_bytes, reset_process_peak
    from memfit.train.step import StepRunner

    def samples_of(step: int) -> tuple[list[int], list[dict]]:
        indices = [int(i) for i in session.schedule.batch_indices(step)]
        return indices, session.task.prepare([session.dataset[i] for i in indices], indices, step)

    device = session.device
    session.model.train()  # as the loop does: a model loaded from a directory comes up in eval mode (no checkpointing)
    runner = StepRunner.from_session(session)
    seconds, results, indices = [], [], []
    synchronize(device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reset_process_peak()  # model loading stays out of the host peak
    upcoming = samples_of(0)
    try:
        with context if context is not None else contextlib.nullcontext():
            last = time.perf_counter()
            for step in range(steps):
                (chosen, samples), upcoming = upcoming, (samples_of(step + 1) if step + 1 < steps else (None, None))
                results.append(runner.run(samples, next_samples=upcoming[1]))
                synchronize(device.type)
                now = time.perf_counter()
                seconds.append(now - last)
                last = now
                indices.append(chosen)
    finally:
        runner.close()
    return {
        "seconds": seconds, "results": results, "indices": indices,
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "host_peak_bytes": int(process_peak_rss_bytes() or 0),
    }


def byte_corpus(directory: str | Path, tokens: int) -> str:
    """A text file of at least `tokens` characters (one byte token each): every window a run of that many tokens reads."""
    words = "memory gradient batch token model layer training fits device loss step context offload tile "
    path = Path(directory) / "corpus.txt"
    path.write_text(words * (tokens // len(words) + 1))
    return str(path)


def emit_result(result: dict[str, Any]) -> None:
    """Hand a worker's result to the parent process (one marked JSON line on stdout)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(
    script: str | Path, spec: dict[str, Any], timeout: float = 900, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `script --worker SPEC` in a fresh Python process and return what it emitted.

    Raises RuntimeError with the worker's last lines of output when it fails.
    """
    command = [sys.executable, str(script), "--worker", json.dumps(spec)]
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f"worker {spec.get('name', '')} failed (exit {completed.returncode}):\n{tail}")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """These environment variables set inside the block, as they were after it (a --quick run in this process)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def machine_description(device_type: str = "cpu") -> str:
    """CPU model and cores (and the GPU when measuring on CUDA), OS, torch and transformers versions."""
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [f"{cpu}, {cores} cores"]
    if device_type == "cuda":
        parts.append(f"{torch.cuda.get_device_name(0)}, driver {_cuda_driver_version()}, CUDA {torch.version.cuda}")
    parts.append(f"{platform.system()} {platform.release()}")
    parts.append(
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    return "; ".join(parts)


def _cuda_driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it ('unknown' without nvidia-smi)."""
    try:
        completed = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return completed.stdout.strip().splitlines()[0] if completed.returncode == 0 and completed.stdout.strip() else "unknown"


def resolve_device(choice: str) -> str:
    """--device auto means CUDA when present."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_label(device: str) -> str:
    """One subsection per kind of machine: 'CPU, 2 cores' or 'CUDA, NVIDIA H100 80GB HBM3'."""
    if device == "cuda":
        import torch

        return f"CUDA, {torch.cuda.get_device_name(0)}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU, {cores} cores"


def today() -> str:
    return datetime.date.today().isoformat()


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


DOC_TITLE = "# Benchmarks\n\nMeasured figures, each with the command and the machine that produced it.\n"


def _replace_block(lines: list[str], marker: str, level: str, block: str) -> list[str]:
    """Replace the block that starts at the line `marker` and runs to the next heading of
    `level` or higher; append the block when the marker is missing."""
    start = next((i for i, line in enumerate(lines) if line.rstrip() == marker), None)
    if start is None:
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        return lines + (["\n"] if lines else []) + block.splitlines(keepends=True)
    stops = tuple("#" * n + " " for n in range(2, len(level) + 1))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(stops)), len(lines))
    rest = lines[end:]
    return lines[:start] + block.splitlines(keepends=True) + (["\n"] if rest else []) + rest


def write_section(path: str | Path, heading: str, body: str, subheading: str | None = None) -> None:
    """Put `body` under `## heading` (and `### subheading` when given) in the markdown file `path`.

    Only that section (or that subsection) is replaced: other `## ` sections, and other
    `### ` subsections of the same section, are kept as they are. A missing file is created.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else DOC_TITLE
    lines = text.splitlines(keepends=True)
    marker = f"## {heading}"
    if subheading is None:
        lines = _replace_block(lines, marker, "##", f"{marker}\n\n{body.strip()}\n")
    else:
        start = next((i for i, line in enumerate(lines) if line.rstrip() == marker), None)
        if start is None:
            lines = _replace_block(lines, marker, "##", f"{marker}\n")
            start = next(i for i, line in enumerate(lines) if line.rstrip() == marker)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        section = _replace_block(lines[start:end], f"### {subheading}", "###", f"### {subheading}\n\n{body.strip()}\n")
        lines = lines[:start] + section + (["\n"] if end < len(lines) and section[-1].strip() else []) + lines[end:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines).rstrip() + "\n")

"""DeepSpeed ZeRO driven by memfit's loop: `--deepspeed ds_config.json`, or `--zero-stage N [--zero-offload]`.

memfit keeps its data order, token-normalized loss, learning-rate schedule and metrics;
DeepSpeed owns the partitioning (ZeRO-1: optimizer state, ZeRO-2: + gradients, ZeRO-3:
+ parameters), the gradient reduction, clipping and the optimizer step, and offload to
the CPU (`offload_optimizer`, `offload_param`).

The configuration file. Values "auto" are filled from memfit's settings, as other
trainers do: train_micro_batch_size_per_gpu (--batch-size), gradient_accumulation_steps,
train_batch_size, gradient_clipping (--max-grad-norm), bf16/fp16 "enabled" (--precision),
and an "optimizer" section's lr, betas, eps and weight_decay. Explicit batch values must
agree with memfit's. Without an "optimizer" section DeepSpeed wraps memfit's own
optimizer (--optimizer); a "scheduler" section is dropped, since memfit's --lr-schedule
drives the learning rate.

The update equals the single-process one: memfit scales each micro-batch's summed token
loss by the target tokens of the whole global batch divided by the ranks (DeepSpeed
averages gradients over ranks) and calls `engine.backward(loss, scale_wrt_gas=False)`,
so DeepSpeed does not divide by the accumulation steps a second time.

OOM recovery is off under DeepSpeed (its ZeRO buffers and collectives cannot take a
half-done micro-batch back); an OOM ends the run with exit code 3.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from memfit.config import TrainConfig
from memfit.distributed.checkpoint_io import load_sharded, save_sharded
from memfit.distributed.context import DistContext
from memfit.distributed.memory import _unique_bytes, optimizer_state_bytes, parameter_bytes
from memfit.distributed.parallel import Parallel, ParallelStepRunner
from memfit.errors import UsageError
from memfit.techniques.loss import causal_lm_loss_sum
from memfit.train.checkpoint import TrainerState, save_final_model

log = logging.getLogger("memfit")

ENGINE_TAG = "engine"


def read_deepspeed_file(path: str) -> dict[str, Any]:
    """The JSON file given to --deepspeed; UsageError when missing or not JSON."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--deepspeed {path}: no such file; give a DeepSpeed JSON config or use --zero-stage 2")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"--deepspeed {path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--deepspeed {path} must hold a JSON object")
    return data


def deepspeed_config(
    config: TrainConfig,
    world_size: int,
    accumulation: int,
    precision_name: str,
    user: dict[str, Any] | None = None,
    notes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config memfit runs: the user's file with "auto" filled, or one made from the flags.

    Raises UsageError when an explicit value disagrees with memfit's run (batch sizes).
    """
    notes = notes if notes is not None else {}
    training, optimizer, distributed = config.training, config.optimizer, config.distributed
    result = copy.deepcopy(user) if user is not None else {}
    micro = training.batch_size
    expected = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
    }
    problems = []
    for key, value in expected.items():
        given = result.get(key, "auto")
        if given != "auto" and int(given) != value:
            problems.append(f'{key} is {given} in the DeepSpeed file but memfit runs {value}; write "auto" or match it')
        result[key] = value
    if problems:
        raise UsageError("; ".join(problems))
    if result.get("gradient_clipping", "auto") == "auto":
        result["gradient_clipping"] = optimizer.max_grad_norm
    for name, on in (("bf16", precision_name == "bf16"), ("fp16", precision_name == "fp16")):
        section = result.setdefault(name, {"enabled": "auto"})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = on
    if "optimizer" in result:
        params = result["optimizer"].setdefault("params", {})
        filled = {
            "lr": optimizer.lr,
            "betas": [optimizer.beta1, optimizer.beta2],
            "eps": optimizer.eps,
            "weight_decay": optimizer.weight_decay,
        }
        for key, value in filled.items():
            if params.get(key, "auto") == "auto":
                params[key] = value
    if "scheduler" in result:
        result.pop("scheduler")
        notes["deepspeed_scheduler"] = (
            "the DeepSpeed file's scheduler section was dropped: memfit's --lr-schedule drives the learning rate"
        )
    zero = result.setdefault("zero_optimization", {})
    if distributed.zero_stage is not None:
        zero["stage"] = distributed.zero_stage
    zero.setdefault("stage", 2)
    if distributed.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]  # bucket sizes and the like: DeepSpeed's defaults
    result.setdefault("zero_allow_untested_optimizer", True)
    result.setdefault("zero_force_ds_cpu_optimizer", False)  # memfit's optimizer may step the offloaded state
    result.setdefault("steps_per_print", 10**9)
    result.setdefault("wall_clock_breakdown", False)
    unresolved = _find_auto(result)
    if unresolved:
        raise UsageError(f'memfit cannot fill "auto" for {", ".join(unresolved)} in the DeepSpeed file; give a value')
    return result


def _find_auto(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        return [name for key, value in data.items() for name in _find_auto(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if data == "auto" else []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _init_deepspeed_comm(dist: DistContext, device: torch.device) -> None:
    import deepspeed

    if not dist.enabled:  # one process: DeepSpeed still wants a process group
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False)


class DeepSpeedStepRunner(ParallelStepRunner):
    """Micro-batches through the DeepSpeed engine: engine.backward, then engine.step at each one."""

    def __init__(self, engine, **kwargs):
        super().__init__(**kwargs)
        self.engine = engine

    def _forward_backward(self, piece, normalizer: float) -> float:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in self.collate(piece.samples).items()}
        mask = batch.get("attention_mask")
        if mask is not None and bool(mask.all()):
            mask = None
        with self._phase("forward"), self.precision.autocast(self.device):
            # The module itself: ZeRO-3 gathers parameters through hooks installed on it.
            loss_sum = causal_lm_loss_sum(self.model, batch["input_ids"], batch["labels"], mask, self.loss_chunk_size)
        with self._phase("backward"):
            self.engine.backward(loss_sum / normalizer, scale_wrt_gas=False)
        with self._phase("optimizer"):
            self.engine.step()  # steps the optimizer only at the accumulation boundary
        return float(loss_sum.detach())

    def _optimizer_step(self, events: list[dict]) -> tuple[float | None, bool]:
        norm = self.engine.get_global_grad_norm()
        return (float(norm) if norm is not None else None), False


class DeepSpeedParallel(Parallel):
    """DeepSpeed ZeRO stage 1, 2 or 3 (see the module docstring)."""

    name = "deepspeed"
    grads_averaged_across_ranks = True

    def __init__(self, config: TrainConfig, dist: DistContext, device: torch.device, notes: dict):
        super().__init__(config, dist, device)
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise UsageError("--deepspeed/--zero-stage need the deepspeed package: pip install deepspeed") from None
        self.user_config = read_deepspeed_file(config.distributed.deepspeed) if config.distributed.deepspeed else None
        self.notes = notes
        self.engine = None
        self.ds_config: dict[str, Any] = {}
        if config.memory.oom_recovery:
            notes["oom_recovery"] = (
                "off under DeepSpeed: a half-done micro-batch cannot be taken back; an OOM ends the run"
            )
        _init_deepspeed_comm(dist, device)

    @property
    def stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    def describe(self) -> str:
        zero = self.ds_config.get("zero_optimization", {})
        offload = [
            name.split("_")[1]
            for name in ("offload_optimizer", "offload_param")
            if zero.get(name, {}).get("device") == "cpu"
        ]
        where = f", offload {'+'.join(offload)} to cpu" if offload else ""
        return f"deepspeed zero-{self.stage} over {self.dist.world_size} rank(s){where}"

    def attach(self, session) -> None:
        import deepspeed

        from memfit.techniques.optimizers import OptimizerChoice, build_scheduler

        self.ds_config = deepspeed_config(
            session.config,
            self.dist.world_size,
            session.accumulation_steps,
            session.precision.name,
            self.user_config,
            session.notes,
        )
        own_optimizer = "optimizer" in self.ds_config
        client = None if own_optimizer else session.optimizer.optimizer
        trainable = [p for p in session.model.parameters() if p.requires_grad]
        engine, optimizer, _, _ = deepspeed.initialize(
            model=session.model, optimizer=client, model_parameters=trainable, config=copy.deepcopy(self.ds_config)
        )
        self.engine = engine
        base = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside ZeRO's wrapper
        if own_optimizer:
            session.optimizer = OptimizerChoice(
                base, f"deepspeed {self.ds_config['optimizer'].get('type', '')}".strip(), ""
            )
            session.scheduler = build_scheduler(base, session.config.optimizer, session.total_steps)
        session.optimizer = OptimizerChoice(
            session.optimizer.optimizer, f"{session.optimizer.name} ({self.describe()})", session.optimizer.reason
        )
        session.scaler = None  # DeepSpeed scales fp16 losses itself
        if self.dist.is_main:
            log.info("memfit: %s", self.describe())

    def make_runner(self, **kwargs):
        kwargs["grads_averaged_across_ranks"] = True
        kwargs["oom_recovery"] = False
        kwargs["scaler"] = None
        self.runner = DeepSpeedStepRunner(self.engine, **kwargs)
        return self.runner

    # -- checkpoints ---------------------------------------------------------

    def save_checkpoint(self, session, state: TrainerState) -> Path:
        def write(directory: Path) -> None:
            self.engine.save_checkpoint(str(directory), tag=ENGINE_TAG, save_latest=False)

        return save_sharded(session.output_dir, state, self.dist, write, session.scheduler, session.config.to_dict())

    def load_checkpoint(self, session, path: Path) -> TrainerState:
        def read(directory: Path) -> None:
            loaded, _ = self.engine.load_checkpoint(str(directory), tag=ENGINE_TAG, load_lr_scheduler_states=False)
            if loaded is None:
                raise ValueError("DeepSpeed found no engine state")

        return load_sharded(path, self.dist, read, session.scheduler)

    def save_final(self, session) -> Path | None:
        """Gather the weights (ZeRO-3 partitions) and write one Hugging Face directory on rank 0."""
        import deepspeed

        model = session.model
        parameters = list(model.parameters())
        gather = (
            deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
            if self.stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            full = (
                {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
                if self.dist.is_main
                else None
            )
        final = None
        if self.dist.is_main:
            final = save_final_model(model, session.loaded.tokenizer, session.output_dir / "final", full)
        self.dist.barrier()
        return final

    # -- metrics -------------------------------------------------------------

    def rank_state_bytes(self, session) -> dict[str, int]:
        base = session.optimizer.optimizer
        wrapper = self.engine.optimizer
        # ZeRO's fp32 partitions: stage 1/2 and stage 3 name them differently.
        flat = (
            getattr(wrapper, "single_partition_of_fp32_groups", None)
            or getattr(wrapper, "fp32_partitioned_groups_flat", None)
            or []
        )
        masters = _unique_bytes(flat)
        return {
            "parameters": parameter_bytes(session.model),
            "master_weights": masters,
            "optimizer_states": optimizer_state_bytes(base),
        }

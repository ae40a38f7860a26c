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
so DeepSpeed does not divide by the accumulation steps a second time. memfit marks the
last micro-batch of each step as the accumulation boundary
(`set_gradient_accumulation_boundary`) and calls DeepSpeed's `step()` once per optimizer
step, after it.

Precision is checked against the device before DeepSpeed starts: a file that asks for
fp16 on a CPU (which DeepSpeed refuses on most CPUs, and memfit never runs there) runs in
memfit's precision instead (fp32, or bf16 with --precision bf16), said in the log and in
the metrics' `fallbacks`; a file that enables both bf16 and fp16 is refused with one line.

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

from memfit.checkpoint_files import TrainerState, save_final_model
from memfit.config import TrainConfig
from memfit.distributed.checkpoint_io import load_sharded, save_sharded
from memfit.distributed.context import DistContext
from memfit.distributed.memory import optimizer_state_bytes, parameter_bytes, unique_bytes
from memfit.distributed.parallel import RankMetrics, gather_events
from memfit.errors import UsageError
from memfit.techniques.optimizers import OptimizerChoice

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
    fallbacks: dict[str, str] | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config memfit runs: the user's file with "auto" filled, or one made from the flags.

    Needs no deepspeed package. Raises UsageError when an explicit value disagrees with
    memfit's run (batch sizes) or cannot run at all (bf16 and fp16 both enabled). On a
    CPU `device` an explicit fp16 is switched off and recorded in `fallbacks`.
    """
    fallbacks = fallbacks if fallbacks is not None else {}
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
    _check_precision_on_device(result, precision_name, device, fallbacks)
    explicit = {name: result.get(name, {}).get("enabled", "auto") is True for name in ("bf16", "fp16")}
    for name, other in (("bf16", "fp16"), ("fp16", "bf16")):
        section = result.setdefault(name, {"enabled": "auto"})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = precision_name == name and not explicit[other]
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
        fallbacks["deepspeed_scheduler"] = (
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


def _check_precision_on_device(
    ds_config: dict[str, Any], precision_name: str, device: torch.device | None, fallbacks: dict[str, str]
) -> None:
    """Refuse what DeepSpeed would reject with a traceback on every rank; switch fp16 off where it cannot run."""
    enabled = {name: ds_config.get(name, {}).get("enabled", "auto") for name in ("bf16", "fp16")}
    if enabled["bf16"] is True and enabled["fp16"] is True:
        raise UsageError(
            'the DeepSpeed file enables both "bf16" and "fp16"; enable one of them, or write "enabled": "auto"'
            " to follow --precision"
        )
    if enabled["fp16"] is True and device is not None and device.type == "cpu":
        ds_config["fp16"]["enabled"] = False
        bf16 = enabled["bf16"] is True or (enabled["bf16"] == "auto" and precision_name == "bf16")
        fallbacks["deepspeed_fp16"] = (
            "the DeepSpeed file asks for fp16, which memfit does not run on a CPU (DeepSpeed refuses it on most,"
            f" and it is far slower than fp32): ran {'bf16' if bf16 else 'fp32'} instead"
            ' (write "fp16": {"enabled": "auto"} to follow --precision)'
        )
        log.warning("memfit: %s", fallbacks["deepspeed_fp16"])


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


class DeepSpeedEngine(RankMetrics):
    """DeepSpeed ZeRO stage 1, 2 or 3 (see the module docstring).

    The DeepSpeed config is resolved and checked against the device when the engine is
    made, before DeepSpeed is imported; `prepare` starts DeepSpeed around the model.
    """

    name = "deepspeed"
    recovers_from_oom = False  # ZeRO's buffers and collectives cannot take a half-done micro-batch back
    scaler = None  # DeepSpeed scales fp16 losses itself

    def __init__(
        self, config: TrainConfig, dist: DistContext, device: torch.device, precision, fallbacks: dict[str, str]
    ):
        self.dist = dist
        self.device = device
        user = read_deepspeed_file(config.distributed.deepspeed) if config.distributed.deepspeed else None
        # The accumulation count is the step's: per data rank (under --context-parallel N, the world over N).
        self.ds_config = deepspeed_config(
            config, dist.world_size, config.accumulation_for(dist.data_world_size), precision.name, user, fallbacks, device
        )
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise UsageError("--deepspeed/--zero-stage need the deepspeed package: pip install deepspeed") from None
        if config.memory.oom_recovery:
            fallbacks["oom_recovery"] = (
                "off under DeepSpeed: a half-done micro-batch cannot be taken back; an OOM ends the run"
            )
        self.ds_engine = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
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

    def prepare(self, model: torch.nn.Module, build_optimizer) -> OptimizerChoice:
        """Start DeepSpeed around `model` and memfit's optimizer, or the file's own "optimizer" section."""
        import deepspeed

        own_optimizer = "optimizer" in self.ds_config
        client = None if own_optimizer else build_optimizer(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, wrapper, _, _ = deepspeed.initialize(
            model=model,
            optimizer=client.optimizer if client is not None else None,
            model_parameters=trainable,
            config=copy.deepcopy(self.ds_config),
        )
        self.ds_engine, self.model = engine, model
        self.optimizer = getattr(wrapper, "optimizer", wrapper)  # the torch optimizer inside ZeRO's wrapper
        if self.dist.is_main:
            log.info("memfit: %s", self.describe())
        if own_optimizer:
            name, reason = f"deepspeed {self.ds_config['optimizer'].get('type', '')}".strip(), ""
        else:
            name, reason = client.name, client.reason
        return OptimizerChoice(self.optimizer, f"{name} ({self.describe()})", reason)

    def loss_normalizer(self, target_tokens: int) -> float:
        # DeepSpeed averages gradients over ranks: scale up by the ranks to get the sum.
        return self.dist.all_reduce_sum(target_tokens) / self.dist.world_size

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        # memfit owns the accumulation boundary (the step calls `clip_and_step` once, after the
        # last micro-batch); scale_wrt_gas=False: the loss is already normalized over the batch.
        self.ds_engine.set_gradient_accumulation_boundary(last_micro_batch)
        # DeepSpeed counts micro-batches in its engine's forward, which memfit does not call (it runs
        # the module itself): without this, ZeRO-3 overwrites the gradients of earlier micro-batches.
        new_micro_batch = getattr(self.ds_engine.optimizer, "clear_backward_seen_flag", None)
        if new_micro_batch is not None:
            new_micro_batch()
        self.ds_engine.backward(loss, scale_wrt_gas=False)

    def reduce_gradients(self) -> None:
        pass  # DeepSpeed reduces (ZeRO-1) or reduce-scatters (ZeRO-2/3) inside backward

    def agree_after_micro_batches(self, micro_batch_size: int, events: list[dict]) -> tuple[int, list[dict]]:
        return micro_batch_size, gather_events(self.dist, events)

    def clip_and_step(self):
        """DeepSpeed's step: clips to gradient_clipping (--max-grad-norm), steps, zeroes the gradients."""
        self.ds_engine.step()
        return self.ds_engine.get_global_grad_norm()

    def use_per_parameter_kernels(self) -> None:
        raise RuntimeError("DeepSpeed does not recover from out-of-memory (recovers_from_oom is False)")

    # -- files -----------------------------------------------------------------

    def save_checkpoint(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict) -> Path:
        def write(directory: Path) -> None:
            self.ds_engine.save_checkpoint(str(directory), tag=ENGINE_TAG, save_latest=False)

        return save_sharded(output_dir, state, self.dist, write, scheduler, config_dict)

    def load_checkpoint(self, path: Path, scheduler: Any) -> TrainerState:
        def read(directory: Path) -> None:
            loaded, _ = self.ds_engine.load_checkpoint(str(directory), tag=ENGINE_TAG, load_lr_scheduler_states=False)
            if loaded is None:
                raise ValueError("DeepSpeed found no engine state")

        return load_sharded(path, self.dist, read, scheduler)

    def save_final_model(self, directory: Path, tokenizer: Any) -> Path | None:
        """Gather the weights (ZeRO-3 partitions) and write one Hugging Face directory on rank 0."""
        import deepspeed

        parameters = list(self.model.parameters())
        gather = (
            deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
            if self.stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            full = (
                {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}
                if self.dist.is_main
                else None
            )
        final = None
        if self.dist.is_main:
            final = save_final_model(self.model, tokenizer, directory, full)
        self.dist.barrier()
        return final

    # -- metrics ---------------------------------------------------------------

    def rank_state_bytes(self) -> dict[str, int]:
        wrapper = self.ds_engine.optimizer
        # ZeRO's fp32 partitions: stage 1/2 and stage 3 name them differently.
        flat = (
            getattr(wrapper, "single_partition_of_fp32_groups", None)
            or getattr(wrapper, "fp32_partitioned_groups_flat", None)
            or []
        )
        return {
            "parameters": parameter_bytes(self.model),
            "master_weights": unique_bytes(flat),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
        }

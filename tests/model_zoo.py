"""A tiny model of every causal-LM family memfit promises to train, built from configs (nothing is downloaded).

`ZOO` maps a family (transformers' `model_type`) to a builder of its tiny config; `zoo_model_dirs` (a session
fixture: import it into a test module) saves each once, with the byte tokenizer, after checking that it trains
in plain transformers (one forward and backward, a finite loss, a gradient on every parameter that the model
uses). A family that transformers adds and that builds tiny joins by one line here; every zoo test then
covers it.

Shapes: vocabulary 257 (the byte tokenizer), width 32, two layers, 4 heads of 8 (2 key-value heads); MoE
families get 4 experts, 2 per token. DeepSeek-V3 and GLM-4-MoE keep their first layer dense
(`first_k_dense_replace=1`) and one shared expert, as the released models do; Jamba alternates Mamba and
attention, experts on every other layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

VOCAB = 257
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, max_position_embeddings=256, eos_token_id=256, pad_token_id=256, bos_token_id=256,
)
EXPERTS = dict(num_experts_per_tok=2)

# family -> the settings beyond COMMON that make it tiny (and, for MoE, routed)
_SETTINGS: dict[str, dict] = {
    "llama": {},
    "qwen3": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8, sliding_window=16),
    "qwen3_moe": dict(head_dim=8, num_experts=4, moe_intermediate_size=32, **EXPERTS),
    "mixtral": dict(num_local_experts=4, **EXPERTS),
    # YaRN's original positions scaled to the tiny context (the default 4096 would warn on every build)
    "gpt_oss": dict(head_dim=8, num_local_experts=4, sliding_window=16, **EXPERTS,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                         rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False)),
    "olmoe": dict(num_experts=4, **EXPERTS),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **EXPERTS),
    "glm4_moe": dict(head_dim=8, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, **EXPERTS),
    "falcon_h1": dict(head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=16),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=16, expand=2),
    "jamba": dict(num_experts=4, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                  attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4, **EXPERTS),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **EXPERTS),
    "phimoe": dict(num_local_experts=4, **EXPERTS),
    "granitemoe": dict(num_local_experts=4, **EXPERTS),
    "phi3": {},
    "smollm3": {},
    "olmo2": {},
}

MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "deepseek_v3", "glm4_moe", "jamba", "qwen2_moe",
                "phimoe", "granitemoe")
"""Families whose tiny model routes tokens to experts (fused 3-D expert parameters)."""
STATE_SPACE_FAMILIES = ("falcon_h1", "mamba2", "jamba")
"""Families with Mamba layers (gated norms, convolutions): techniques for attention blocks must leave them."""


def _builder(family: str) -> Callable[[], object]:
    def build():
        from transformers import AutoConfig

        return AutoConfig.for_model(family, **{**COMMON, **_SETTINGS[family]})

    build.__name__ = f"tiny_{family}_config"
    return build


ZOO: dict[str, Callable[[], object]] = {family: _builder(family) for family in _SETTINGS}
"""family -> a builder of its tiny transformers config."""


def build_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny model of `family`, initialised from `seed` (two builds are equal)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(ZOO[family](), dtype=dtype)


def randomize_adapters(model) -> None:
    """Give every LoRA B matrix random values (seed 1, scale 0.2): B starts at zero, so an adapter's gradients
    and outputs would not tell a wrong path from a right one."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def check_trains_in_transformers(model) -> float:
    """One forward and backward in plain transformers: the loss is finite and gradients reach the weights.

    Returns the loss. Raises AssertionError naming what failed, so a family that transformers itself cannot
    train is found here, not blamed on memfit.
    """
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (2, 24), generator=generator)
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    assert torch.isfinite(loss), f"{model.config.model_type}: loss {loss.item()} in plain transformers"
    loss.backward()
    with_grad = sum(1 for p in model.parameters() if p.grad is not None and torch.isfinite(p.grad).all())
    assert with_grad > 0.9 * sum(1 for _ in model.parameters()), f"{model.config.model_type}: few gradients"
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def save_family(family: str, directory: Path) -> Path:
    """Build, check in plain transformers, and save `family`'s tiny model with the byte tokenizer."""
    from memfit.models.tiny import byte_tokenizer

    model = build_model(family)
    check_trains_in_transformers(model)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


# Each test module that imports a fixture below holds its own copy of it for pytest (a fixture is registered per
# module that names it), so a session fixture would run once per module: what they build is kept here instead,
# once per process.
_BUILT: dict[str, object] = {}


@pytest.fixture(scope="session")
def zoo_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a directory with its tiny model (save_pretrained) and the byte tokenizer, saved once."""
    if "dirs" not in _BUILT:
        root = tmp_path_factory.mktemp("zoo")
        _BUILT["dirs"] = {family: save_family(family, root / family) for family in ZOO}
    return _BUILT["dirs"]


ZOO_GROUP = "model-zoo"
"""The pytest-xdist group of the test files that read `zoo_commands`: one worker builds it once."""


@pytest.fixture(scope="session")
def zoo_commands(request, zoo_model_dirs, text_file, tmp_path_factory) -> dict[str, dict]:
    """{module's name: {key: result of its command}}: the commands of every module of ZOO_GROUP, run in ONE process.

    Each module names its commands with `zoo_commands_of(zoo_model_dirs, text_file, out) -> {key: argv}`. Sharing
    the process saves a start and every per-process cache the commands fill: a family's layer probe (Jamba's Mamba
    scan on fake tensors: tens of seconds), measured by `memfit estimate` and read again by `memfit train`'s
    speed prediction.
    """
    if "commands" in _BUILT:
        return _BUILT["commands"]
    out = tmp_path_factory.mktemp("zoo-runs")
    modules = {item.module.__name__: item.module for item in request.session.items
               if (group := item.get_closest_marker("xdist_group")) is not None and group.args[0] == ZOO_GROUP}
    keyed = [(name, key, argv) for name, module in sorted(modules.items())
             for key, argv in module.zoo_commands_of(zoo_model_dirs, text_file, out).items()]
    results = run_in_one_process([argv for _, _, argv in keyed], timeout=1800)
    shared: dict[str, dict] = {name: {} for name in modules}
    for (name, key, _), result in zip(keyed, results, strict=True):
        shared[name][key] = result
    _BUILT["commands"] = shared
    return shared


def run_in_one_process(commands: list[list[str]], timeout: int = 600) -> list[dict]:
    """Run each `memfit ARGS` of `commands` in one fresh Python process, one after another (imports paid once).

    Returns, per command, {"args", "returncode", "stderr", "stdout", "seconds"}: stderr is read at the file
    descriptor, so a traceback that torch or a library logs through a handler of its own is caught too. One
    thread per process: on a shared 2-core machine torch's thread pool spins against the other runs and makes
    a tiny model's step a hundred times slower.
    """
    with tempfile.TemporaryDirectory() as scratch:
        spec = Path(scratch) / "commands.json"
        spec.write_text(json.dumps(commands))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=Path(__file__).resolve().parents[1])
        results = Path(scratch) / "results.json"
        if not results.exists():
            raise AssertionError(f"the zoo runner died (exit {done.returncode}): {done.stderr[-3000:]}")
        return json.loads(results.read_text())


def _serve(spec: Path) -> None:
    """The child of `run_in_one_process`: each command through memfit.cli.main.main, its fd 1 and 2 captured."""
    import time

    import torch

    from memfit.cli.main import main

    torch.set_num_threads(1)
    results = []
    for args in json.loads(spec.read_text()):
        with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            start = time.perf_counter()
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # an escaped exception is a failure the test reports with its traceback
                import traceback

                traceback.print_exc()
                code = -1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            seconds = time.perf_counter() - start
            err.seek(0)
            out.seek(0)
            results.append({"args": args, "returncode": code, "stderr": err.read(), "stdout": out.read(),
                            "seconds": round(seconds, 2)})
    (spec.parent / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
    # Skip the interpreter's teardown of torch's and transformers' modules (seconds): the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

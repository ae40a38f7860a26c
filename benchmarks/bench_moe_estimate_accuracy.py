"""How close are memfit's estimates to the measured peak on mixture-of-experts models?

The same measurement as bench_estimate_accuracy.py (two real CPU training steps, the second one's peak counted
by memfit's MemoryTracker, against `estimate(config, method=...)`), on small MoE models built from transformers
configs: Qwen3-MoE, gpt-oss, Mixtral, OLMoE, DeepSeek-V3 and GLM-4-MoE (with their dense first layer and shared
expert). None of them was used to fit any term of the estimator: they are held out.

    python benchmarks/bench_moe_estimate_accuracy.py --out moe_table.md
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_estimate_accuracy import VARIANTS, AccuracyTable, measured_peak  # noqa: E402

from memfit.config_loading import load_config  # noqa: E402
from memfit.prediction.estimator import estimate  # noqa: E402

COMMON = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
ROUTED = dict(num_experts_per_tok=2)
MOE = {
    "qwen3_moe": dict(head_dim=32, num_experts=8, moe_intermediate_size=96, **ROUTED),
    "gpt_oss": dict(head_dim=32, num_local_experts=8, sliding_window=64, intermediate_size=96, **ROUTED,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                                         rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False)),
    "mixtral": dict(num_local_experts=8, intermediate_size=96, **ROUTED),
    "olmoe": dict(num_experts=8, intermediate_size=96, **ROUTED),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=64, kv_lora_rank=64,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, **ROUTED),
    "glm4_moe": dict(head_dim=32, n_routed_experts=8, moe_intermediate_size=96, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, **ROUTED),
}


def architectures() -> dict:
    from transformers import AutoConfig

    return {name: AutoConfig.for_model(name, **{**COMMON, **extra}) for name, extra in MOE.items()}


def compare(hf_config, config) -> tuple[int, int, int]:
    """(measured, analytical, traced) peak bytes of one config."""
    truth = measured_peak(hf_config, config)
    analytical = estimate(config, hf_config=hf_config).peak_bytes
    traced = estimate(config, hf_config=hf_config, method="traced").peak_bytes
    return truth, analytical, traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the markdown table here as well as to stdout")
    parser.add_argument("--seq-lens", default="128,512")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--archs", default=None, help=f"comma-separated subset of: {', '.join(MOE)}")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    chosen = {n: c for n, c in architectures().items() if args.archs is None or n in args.archs.split(",")}
    variants = {n: v for n, v in VARIANTS.items() if args.variants is None or n in args.variants.split(",")}
    table = AccuracyTable()
    for (name, hf_config), (variant, changes), seq_len in itertools.product(chosen.items(), variants.items(), seq_lens):
        config = load_config(overrides={"seq_len": seq_len, "batch_size": args.batch_size, **changes})
        truth, analytical, traced = compare(hf_config, config)
        table.add(name, variant, seq_len, truth, analytical, traced)
    text = table.text(platform.processor() or platform.machine(), args.batch_size)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

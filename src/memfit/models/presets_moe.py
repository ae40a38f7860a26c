"""Presets of the mixtures of experts and the dense decoders people fine-tune now, from their published configs.

Each preset holds the numbers of the model's config.json on the Hugging Face Hub (the id is the preset's
`hf_id`); `PUBLISHED_PARAMETERS` keeps the totals (and for a mixture of experts the parameters active per token)
that the model cards state, which tests/unit/test_presets.py checks the built architecture against. Gemma 3
4B-27B are multimodal checkpoints: the preset is their text decoder (`gemma3_text`), as `memfit train` fine-tunes
it; gpt-oss ships its experts in MXFP4, and a preset (like `memfit train`) builds them in the load dtype.
"""

from __future__ import annotations

_QWEN3 = {"rope_theta": 1000000.0}
# gpt-oss: attention sinks, alternating 128-token sliding and full attention, YaRN from 4096 positions
_GPT_OSS = {
    "head_dim": 64, "sliding_window": 128, "attention_bias": True, "num_experts_per_tok": 4,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                        "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
}
_LLAMA33_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}}

MOE_PRESETS = (
    ("gpt-oss-20b", "openai/gpt-oss-20b", "gpt_oss", 2880, 24, 64, 8, 2880, 201088, 131072, False,
                _GPT_OSS | {"num_local_experts": 32}),
    ("gpt-oss-120b", "openai/gpt-oss-120b", "gpt_oss", 2880, 36, 64, 8, 2880, 201088, 131072, False,
                _GPT_OSS | {"num_local_experts": 128}),
    ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 40960, False,
                _QWEN3 | {"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                          "norm_topk_prob": True}),
    ("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", "qwen3_moe", 4096, 94, 64, 4, 12288, 151936, 40960, False,
                _QWEN3 | {"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 1536, "norm_topk_prob": True}),
    ("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "mixtral", 4096, 32, 32, 8, 14336, 32000, 32768, False,
                {"rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2}),
    ("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", "olmoe", 2048, 16, 16, 16, 1024, 50304, 4096, False,
                {"num_experts": 64, "num_experts_per_tok": 8}),
)

DENSE_PRESETS = (
    ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 3072, 151936, 40960, True,
                _QWEN3 | {"head_dim": 128}),
    ("qwen3-1.7b", "Qwen/Qwen3-1.7B", "qwen3", 2048, 28, 16, 8, 6144, 151936, 40960, True,
                _QWEN3 | {"head_dim": 128}),
    ("qwen3-4b", "Qwen/Qwen3-4B", "qwen3", 2560, 36, 32, 8, 9728, 151936, 40960, True,
                _QWEN3 | {"head_dim": 128}),
    ("qwen3-8b", "Qwen/Qwen3-8B", "qwen3", 4096, 36, 32, 8, 12288, 151936, 40960, False,
                _QWEN3 | {"head_dim": 128}),
    ("qwen3-14b", "Qwen/Qwen3-14B", "qwen3", 5120, 40, 40, 8, 17408, 151936, 40960, False,
                _QWEN3 | {"head_dim": 128}),
    ("qwen3-32b", "Qwen/Qwen3-32B", "qwen3", 5120, 64, 64, 8, 25600, 151936, 40960, False,
                _QWEN3 | {"head_dim": 128}),
    ("gemma-3-1b", "google/gemma-3-1b-pt", "gemma3_text", 1152, 26, 4, 1, 6912, 262144, 32768, True,
                {"head_dim": 256, "sliding_window": 512}),
    ("gemma-3-4b", "google/gemma-3-4b-pt", "gemma3_text", 2560, 34, 8, 4, 10240, 262208, 131072, True,
                {"head_dim": 256, "sliding_window": 1024}),
    ("gemma-3-12b", "google/gemma-3-12b-pt", "gemma3_text", 3840, 48, 16, 8, 15360, 262208, 131072, True,
                {"head_dim": 256, "sliding_window": 1024}),
    ("gemma-3-27b", "google/gemma-3-27b-pt", "gemma3_text", 5376, 62, 32, 16, 21504, 262208, 131072, True,
                {"head_dim": 128, "sliding_window": 1024, "query_pre_attn_scalar": 168}),
    ("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "llama", 8192, 80, 64, 8, 28672, 128256, 131072,
                False, _LLAMA33_ROPE),
    ("phi-4", "microsoft/phi-4", "phi3", 5120, 40, 40, 10, 17920, 100352, 16384, False,
                {"rope_theta": 250000.0}),
    ("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", "smollm3", 2048, 36, 16, 4, 11008, 128256, 65536, True,
                {"rope_theta": 5000000.0}),
)

PUBLISHED_PARAMETERS: dict[str, tuple[float, float | None]] = {
    # name: (total, active per token) in billions, as the model cards state them
    "gpt-oss-20b": (20.9, 3.6), "gpt-oss-120b": (116.8, 5.1),
    "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0),
    "mixtral-8x7b": (46.7, 12.9), "olmoe-1b-7b": (6.9, 1.3),
    "qwen3-0.6b": (0.6, None), "qwen3-1.7b": (1.7, None), "qwen3-4b": (4.0, None), "qwen3-8b": (8.2, None),
    "qwen3-14b": (14.8, None), "qwen3-32b": (32.8, None),
    "gemma-3-1b": (1.0, None), "gemma-3-4b": (3.88, None), "gemma-3-12b": (11.77, None), "gemma-3-27b": (27.0, None),
    "llama-3.3-70b": (70.6, None), "phi-4": (14.7, None), "smollm3-3b": (3.08, None),
}

MOE_AND_RECENT_PRESETS = {row[0]: row for row in MOE_PRESETS + DENSE_PRESETS}
"""name -> the arguments of models.presets.ModelPreset (name, hf_id, model_type, hidden, layers, heads, kv heads,
intermediate, vocabulary, positions, tied embeddings, extra fields), which registers them."""

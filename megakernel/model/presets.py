"""Named model shapes: the real checkpoints' config.json values, and tiny ones for CPU tests."""

from __future__ import annotations

from .config import ModelConfig, RopeScaling

_LLAMA3_1B_ROPE = RopeScaling(
    "llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3_8B_ROPE = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=_LLAMA3_1B_ROPE, rms_norm_eps=1e-5, qk_norm=False,
        max_position_embeddings=131072, name="llama-3.2-1b",
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6, qk_norm=True,
        max_position_embeddings=40960, name="qwen3-0.6b",
    ),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling=_LLAMA3_8B_ROPE, rms_norm_eps=1e-5, qk_norm=False,
        max_position_embeddings=131072, name="llama-3.1-8b",
    ),
    # meta-llama/Llama-2-7b-hf: full multi-head attention, and an FFN of 11008 = 43 x 256 columns (an odd,
    # prime number of 256-column passes: the shape the kernel's last-slab remainder exists for)
    "llama-2-7b": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False,
        rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5, qk_norm=False,
        max_position_embeddings=4096, name="llama-2-7b",
    ),
    # Small shapes with the same structure (GQA, llama3 RoPE scaling / QK-norm) for fast CPU tests.
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=768, vocab_size=1024, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=_LLAMA3_1B_ROPE, rms_norm_eps=1e-5, qk_norm=False,
        max_position_embeddings=131072, name="tiny-llama",
    ),
    # q_size (512) != hidden_size (256), as in the real Qwen3 models (2048 vs 1024); untied head.
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=128, intermediate_size=768, vocab_size=1024, tie_word_embeddings=False,
        rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6, qk_norm=True,
        max_position_embeddings=40960, name="tiny-qwen3",
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None

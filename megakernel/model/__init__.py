"""Model description: configs, presets, reference ops, paged KV cache, weights, reference decoder.
Knows nothing of schedules or kernels."""

from .config import ModelConfig, RopeScaling
from .kv_cache import PagedKVCache, contiguous_block_table
from .ops import apply_rope, paged_attention_decode, rms_norm, rope_cos_sin, rope_inv_freq, silu_and_mul
from .presets import PRESETS, get_preset
from .reference import GenerationResult, ReferenceDecoder
from .weights import (
    CheckpointError,
    LayerWeights,
    ModelWeights,
    from_hf_state_dict,
    load_checkpoint,
    random_weights,
    save_checkpoint,
    to_hf_state_dict,
)

__all__ = [
    "ModelConfig", "RopeScaling", "PRESETS", "get_preset",
    "PagedKVCache", "contiguous_block_table",
    "apply_rope", "paged_attention_decode", "rms_norm", "rope_cos_sin", "rope_inv_freq", "silu_and_mul",
    "CheckpointError", "LayerWeights", "ModelWeights", "from_hf_state_dict", "load_checkpoint",
    "random_weights", "save_checkpoint", "to_hf_state_dict",
    "GenerationResult", "ReferenceDecoder",
]

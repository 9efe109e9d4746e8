"""DeepSeek-V3 / Kimi-K2 architecture (MLA attention + MoE): config, presets, packed weights,
reference decoder and decode bandwidth floor."""

from .config import LATENT_NORM_EPS, DeepseekConfig, YarnScaling, yarn_mscale
from .floor import decode_bytes, expected_distinct_experts, floor_ms
from .presets import PRESETS, get_preset, kimi_k2_slice
from .reference import (
    DeepseekReferenceDecoder,
    GenerationResult,
    LatentKVCache,
    contiguous_block_table,
    mla_decode_absorbed,
    mla_decode_naive,
    route,
)
from .weights import (
    DeepseekLayerWeights,
    DeepseekWeights,
    MissingTensorError,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)

__all__ = [
    "LATENT_NORM_EPS",
    "DeepseekConfig",
    "YarnScaling",
    "yarn_mscale",
    "decode_bytes",
    "expected_distinct_experts",
    "floor_ms",
    "PRESETS",
    "get_preset",
    "kimi_k2_slice",
    "DeepseekReferenceDecoder",
    "GenerationResult",
    "LatentKVCache",
    "contiguous_block_table",
    "mla_decode_absorbed",
    "mla_decode_naive",
    "route",
    "DeepseekLayerWeights",
    "DeepseekWeights",
    "MissingTensorError",
    "load_checkpoint",
    "random_weights",
    "save_checkpoint",
]

"""Kimi Linear architecture (KDA linear attention + NoPE MLA, MoE with shared experts): config, presets,
weights and a float32 reference decoder, proven against transformers' KimiLinearForCausalLM."""

from .config import KimiLinearConfig
from .presets import PRESETS, get_preset, kimi_linear_slice
from .reference import (
    GenerationResult,
    KDAStateCache,
    KimiLinearCache,
    KimiLinearReferenceDecoder,
    kda_recurrent_step,
)
from .weights import (
    KDAWeights,
    KimiLinearLayerWeights,
    KimiLinearWeights,
    MissingTensorError,
    MLAWeights,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)

__all__ = [
    "KimiLinearConfig",
    "PRESETS",
    "get_preset",
    "kimi_linear_slice",
    "GenerationResult",
    "KDAStateCache",
    "KimiLinearCache",
    "KimiLinearReferenceDecoder",
    "kda_recurrent_step",
    "KDAWeights",
    "KimiLinearLayerWeights",
    "KimiLinearWeights",
    "MissingTensorError",
    "MLAWeights",
    "load_checkpoint",
    "random_weights",
    "save_checkpoint",
]

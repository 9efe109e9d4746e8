"""vLLM general plugin (entry point ``vllm.general_plugins: megakernel``): registers the megakernel
model classes with vLLM's ``ModelRegistry``.

``register()`` maps the two megakernel names and, unless ``MEGAKERNEL_VLLM`` says off, the stock
``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` names to the megakernel classes. Those classes decode
through the megakernel only where one of three switches says so (the first that is set wins):

- ``additional_config={"megakernel": true}`` on ``vllm.LLM`` / ``vllm serve --additional-config``
  (vLLM's own per-instance settings; ``{"megakernel": {"max_batch": 4}}`` also sets the largest decode
  batch sent to the kernel; ``{"megakernel": false}`` keeps that instance stock whatever else is set);
- ``hf_overrides={"architectures": ["MegakernelLlamaForCausalLM"]}`` (or
  ``"MegakernelQwen3ForCausalLM"``; ``vllm serve --hf-overrides``): that model;
- ``MEGAKERNEL_VLLM=1`` in the environment of every vLLM process: every Llama / Qwen3 checkpoint.

Otherwise an instance runs vLLM's stock code throughout (it builds nothing and packs nothing), and
``MEGAKERNEL_VLLM=0`` leaves the stock names to vLLM's own classes altogether.

vLLM loads general plugins in every process it starts, through the entry point (so the package must
be installed); a program that runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) can call
``register()`` itself instead. Classes are registered as ``"module:Class"`` strings, so vLLM imports
``megakernel.integrations.vllm_model`` only when a model needs it. This module imports nothing from
vLLM until ``register()`` runs, and ``register()`` without vLLM logs a warning and returns False.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger("vllm.megakernel")

ENV_SWITCH = "MEGAKERNEL_VLLM"
MODEL_MODULE = "megakernel.integrations.vllm_model"

# megakernel architecture name -> the stock vLLM architecture it extends (its class in MODEL_MODULE
# has the megakernel name).
ARCHITECTURES: dict[str, str] = {
    "MegakernelLlamaForCausalLM": "LlamaForCausalLM",
    "MegakernelQwen3ForCausalLM": "Qwen3ForCausalLM",
}
STOCK_TO_MEGAKERNEL: dict[str, str] = {stock: mk for mk, stock in ARCHITECTURES.items()}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_override(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether MEGAKERNEL_VLLM switches the megakernel on for every Llama / Qwen3 model."""
    return environ.get(ENV_SWITCH, "").strip().lower() in _TRUE


def env_refuses(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether MEGAKERNEL_VLLM says off (0, false, no, off), which leaves the stock names to vLLM's own
    classes. An unrecognised value counts as off, with a warning (a plugin that raised would stop vLLM
    from starting); unset or empty does not."""
    value = environ.get(ENV_SWITCH, "").strip().lower()
    if value in _TRUE or value == "":
        return False
    if value not in _FALSE:
        logger.warning("%s=%r is not one of %s / %s; the stock vLLM classes stay in place",
                       ENV_SWITCH, environ.get(ENV_SWITCH), "|".join(_TRUE), "|".join(_FALSE[1:]))
    return True


def registrations(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Architecture name -> "module:Class" that register() installs, given the environment."""
    table = {mk: f"{MODEL_MODULE}:{mk}" for mk in ARCHITECTURES}
    if not env_refuses(environ):
        table.update({stock: f"{MODEL_MODULE}:{mk}" for stock, mk in STOCK_TO_MEGAKERNEL.items()})
    return table


def stock_architecture(name: str) -> str:
    """The stock architecture a (possibly megakernel) architecture name stands for."""
    return ARCHITECTURES.get(name, name)


def uses_megakernel(architectures: list[str] | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a model whose config lists `architectures` is built from a megakernel class (which decodes
    through the megakernel where a switch says so: megakernel.integrations.vllm_mapping.switch_setting)."""
    table = registrations(environ)
    return any(table.get(a, "").startswith(MODEL_MODULE + ":") for a in architectures or [])


def register(registry=None, environ: Mapping[str, str] = os.environ) -> bool:
    """Register the megakernel classes (see the module docstring). Safe to call more than once.

    `registry` defaults to ``vllm.ModelRegistry``. Returns True when the classes were registered,
    False (with a warning) when vLLM cannot be imported."""
    if registry is None:
        try:
            from vllm import ModelRegistry as registry  # noqa: N813
        except ImportError as exc:
            logger.warning("megakernel: vLLM is not importable (%s); nothing registered", exc)
            return False
    table = registrations(environ)
    for arch, target in table.items():
        registry.register_model(arch, target)
    if env_override(environ):
        logger.info("megakernel: %s=1, decode of %s goes through the megakernel", ENV_SWITCH,
                    ", ".join(sorted(STOCK_TO_MEGAKERNEL)))
    else:
        logger.debug("megakernel: registered %s", ", ".join(table))
    return True

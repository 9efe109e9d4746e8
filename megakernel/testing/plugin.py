"""pytest plugin (entry point `pytest11: megakernel`): fixtures, markers and hypothesis profiles.

Fixtures
    cuda_device      torch.device("cuda", 0); skips the test with a reason where no CUDA device is present
    tolerances       the per-dtype atol/rtol table (megakernel.testing.tolerances.TOLERANCES)
    preset_config    factory: preset_config("tiny-llama", num_layers=1) -> ModelConfig
    seeded_weights   factory: seeded_weights(config_or_preset, seed=0, dtype=float32, device="cpu") -> ModelWeights
    baseline_timer   timer(fn) -> median ms per call over CUDA-graph replays, timed with CUDA events
    bandwidth_floor  measured read bandwidth of the GPU, bytes/s, once per test run
    perf_thresholds  the per-GPU ratio thresholds file (megakernel.testing.perf.PerfThresholds) named by
                     --perf-thresholds PATH or the ini option megakernel_perf_thresholds (none: nothing enforced)
    nvtx_range       factory: nvtx_range("label") -> a context manager around a timed region (domain megakernel)
Options
    --perf-thresholds PATH, ini megakernel_perf_thresholds: the TOML file of per-GPU ratio thresholds
Hooks
    tests marked `gpu` are skipped with reason "no CUDA device" where torch sees none;
    tests marked `hopper` (the megakernel's own: they build and launch it) also where device 0 is not a Hopper
    GPU (compute capability 9.0), with the device's capability in the reason;
    tests marked `vllm` are skipped where vLLM is not installed.
Hypothesis profiles
    "ci" (derandomized, 10 examples), "dev" (50 examples), "fuzz" (5,000 examples), all without deadline;
    chosen by the environment variable HYPOTHESIS_PROFILE, else "ci" where CI is set, else "dev".

torch and hypothesis are imported lazily, so pytest runs that do not use them pay nothing for the plugin.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

MARKERS = {
    "gpu": "needs a CUDA device (skipped with a reason where none is present)",
    "hopper": "launches the megakernel: needs a Hopper GPU, sm_90 (skipped with a reason on any other device)",
    "perf": "timing benchmarks with ratio thresholds (run with -m perf on a GPU runner)",
    "e2e": "end-to-end generation parity",
    "vllm": "needs vLLM installed",
    "sanitizer": "runs the megakernel under compute-sanitizer (tools/sanitize.py; minutes on a GPU host)",
    "slow": "long-running tests",
}

HYPOTHESIS_PROFILES = {
    "ci": {"derandomize": True, "max_examples": 10, "database": None},
    "dev": {"max_examples": 50},
    "fuzz": {"max_examples": 5000},
}
# examples per test of the fuzz profile where this is set: on the GPU every example with a new shape compiles
# a kernel (seconds each), so a fuzz run that must end within a device call sizes itself (tools/gpu_run.sh fuzz)
FUZZ_EXAMPLES_ENV = "MEGAKERNEL_FUZZ_EXAMPLES"


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of CUDA device 0, None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_capability(0) if cuda_available() else None


def hopper_skip_reason(capability: tuple[int, int] | None) -> str | None:
    """Why a `hopper` test cannot run on a device of this capability (None: it can): the kernel's cubin is
    sm_90a (megakernel.instructions.layout.KERNEL_CAPABILITY)."""
    from megakernel.instructions.layout import KERNEL_CAPABILITY

    if capability is None:
        return "no CUDA device"
    if tuple(capability) != KERNEL_CAPABILITY:
        major, minor = capability
        return f"the megakernel runs on Hopper GPUs (sm_90) only; CUDA device 0 is sm_{major}{minor}"
    return None


def hypothesis_profile_name(environ=os.environ) -> str:
    """The profile to load: HYPOTHESIS_PROFILE, else "ci" when CI is set (and not "false"/"0"), else "dev"."""
    name = environ.get("HYPOTHESIS_PROFILE")
    if name:
        return name
    return "ci" if environ.get("CI", "").lower() not in ("", "0", "false") else "dev"


def register_hypothesis_profiles() -> None:
    from hypothesis import HealthCheck, settings

    # From hypothesis' own defaults, not from whatever profile is loaded now (it loads its CI profile
    # by itself where CI is set, and a "fuzz" run must not inherit derandomize from that).
    base = settings.get_profile("default")
    for name, kw in HYPOTHESIS_PROFILES.items():
        if name == "fuzz" and os.environ.get(FUZZ_EXAMPLES_ENV):
            kw = {**kw, "max_examples": int(os.environ[FUZZ_EXAMPLES_ENV])}
        # Kernel-sized examples are slow and vary in time: no deadline, and no too_slow health check.
        settings.register_profile(name, parent=base, deadline=None, print_blob=True,
                                  suppress_health_check=[HealthCheck.too_slow], **kw)


@pytest.hookimpl(tryfirst=True)   # before hypothesis' own plugin, so its --hypothesis-profile still wins
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--perf-thresholds", default=None, metavar="PATH",
                     help="TOML file of per-GPU ratio thresholds for perf tests (megakernel.testing.perf); "
                          "overrides the ini option megakernel_perf_thresholds")
    parser.addini("megakernel_perf_thresholds", "TOML file of per-GPU ratio thresholds for perf tests, relative "
                  "to the rootdir (megakernel.testing.perf)", default="")


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    if importlib.util.find_spec("hypothesis") is None:
        return
    register_hypothesis_profiles()
    from hypothesis import settings

    name = hypothesis_profile_name()
    if name not in HYPOTHESIS_PROFILES:
        try:
            settings.get_profile(name)
        except Exception:
            raise pytest.UsageError(f"HYPOTHESIS_PROFILE={name!r} is not a hypothesis profile; "
                                    f"megakernel registers {', '.join(HYPOTHESIS_PROFILES)}") from None
    settings.load_profile(name)


def pytest_report_header(config: pytest.Config) -> list[str]:
    line = "megakernel: "
    if importlib.util.find_spec("hypothesis") is not None:
        line += f"hypothesis profile {hypothesis_profile_name()!r}"
    return [line]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="no CUDA device")
        for item in gpu_items:
            item.add_marker(skip)
    hopper_items = [item for item in items if item.get_closest_marker("hopper") is not None]
    reason = hopper_skip_reason(cuda_capability()) if hopper_items else None
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in hopper_items:
            item.add_marker(skip)
    vllm_items = [item for item in items if item.get_closest_marker("vllm") is not None]
    if vllm_items and importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vLLM not installed")
        for item in vllm_items:
            item.add_marker(skip)


# -- fixtures --------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_device():
    """The first CUDA device; the test is skipped where there is none."""
    if not cuda_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    import torch

    return torch.device("cuda", 0)


@pytest.fixture
def one_cpu_thread():
    """torch on one intra-op CPU thread for the test, then as before: tiny CPU ops (VM steps, stage
    references, small reference models) lose more to thread hand-offs and OpenMP barriers than they gain."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tolerances():
    """Per-dtype Tolerance(atol, rtol), keyed by torch dtype; each entry says why in tolerances.py."""
    from megakernel.testing.tolerances import TOLERANCES

    return TOLERANCES


@pytest.fixture
def preset_config():
    """Factory: preset_config(name="tiny-llama", **field_overrides) -> ModelConfig."""
    import dataclasses

    from megakernel.model.presets import get_preset

    def make(name: str = "tiny-llama", **overrides):
        config = get_preset(name)
        return dataclasses.replace(config, **overrides) if overrides else config

    return make


@pytest.fixture
def seeded_weights():
    """Factory: seeded_weights(config_or_preset="tiny-llama", seed=0, dtype=float32, device="cpu", std=None)."""
    import torch

    from megakernel.model.presets import get_preset
    from megakernel.model.weights import random_weights

    def make(config="tiny-llama", seed: int = 0, dtype=torch.float32, device="cpu", std=None):
        if isinstance(config, str):
            config = get_preset(config)
        return random_weights(config, seed=seed, dtype=dtype, device=device, std=std)

    return make


@pytest.fixture
def baseline_timer(cuda_device):
    """timer(fn, warmup=3, replays=20, repeats=7) -> median ms per call of fn, over CUDA-graph replays."""
    from megakernel.integrations.bench import time_cuda_graph

    return time_cuda_graph


@pytest.fixture(scope="session")
def bandwidth_floor():
    """Bytes/s of a pure read of 2 GiB on GPU 0, measured once per test run (skips without CUDA)."""
    if not cuda_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    from megakernel.integrations.floor import measure_read_bandwidth

    return measure_read_bandwidth(device="cuda")


@pytest.fixture(scope="session")
def perf_thresholds(pytestconfig: pytest.Config):
    """The thresholds file named by --perf-thresholds or the ini option (relative paths from the rootdir);
    an empty PerfThresholds, which enforces nothing, where neither names one."""
    from pathlib import Path

    from .perf import PerfThresholds

    path = pytestconfig.getoption("--perf-thresholds") or pytestconfig.getini("megakernel_perf_thresholds")
    if not path:
        return PerfThresholds()
    path = Path(path)
    return PerfThresholds.load(path if path.is_absolute() else pytestconfig.rootpath / path)


@pytest.fixture
def nvtx_range():
    """nvtx_range("label") -> a context manager: an NVTX range (domain "megakernel") around a timed region."""
    from .perf import nvtx_range as make

    return make


"""The pytest plugin (fixtures, gpu auto-skip, hypothesis profiles), the tolerance table and the strategies."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch
from hypothesis import find, given, settings

import megakernel.testing.plugin as plugin
from megakernel.testing.strategies import decode_shapes, kv_lengths, rope_positions, seeds
from megakernel.testing.tolerances import TOLERANCES, assert_close, tolerance_for


def _plugin_args() -> list[str]:
    """`-p` for the plugin unless pytest already loads it through the installed entry point."""
    installed = any(ep.value == "megakernel.testing.plugin"
                    for ep in importlib.metadata.entry_points(group="pytest11"))
    if installed and not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return []
    return ["-p", "megakernel.testing.plugin"]


@pytest.fixture
def keep_hypothesis_profile():
    """An inner pytest run loads a profile globally; put the outer run's back afterwards."""
    name = settings.get_current_profile_name()
    yield
    settings.load_profile(name)


FIXTURE_TESTS = '''
import pytest, torch

def test_tolerances(tolerances):
    assert tolerances[torch.bfloat16].rtol > tolerances[torch.float16].rtol > tolerances[torch.float32].rtol

def test_preset_config(preset_config):
    cfg = preset_config("tiny-qwen3", num_layers=1)
    assert cfg.num_layers == 1 and cfg.qk_norm and cfg.name == "tiny-qwen3"
    assert preset_config().name == "tiny-llama"

def test_seeded_weights(seeded_weights):
    a, b, c = seeded_weights("tiny-llama", seed=3), seeded_weights("tiny-llama", seed=3), seeded_weights("tiny-llama", seed=4)
    assert a.embed.dtype == torch.float32
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv)
    assert not torch.equal(a.layers[1].qkv, c.layers[1].qkv)

def test_cuda_device(cuda_device):
    assert cuda_device.type == "cuda"

@pytest.mark.gpu
def test_marked_gpu():
    assert torch.cuda.is_available()

def test_bandwidth_floor(bandwidth_floor):
    assert 1e11 < bandwidth_floor < 1e14   # between 0.1 and 100 TB/s

def test_baseline_timer(baseline_timer, cuda_device):
    x = torch.randn(1024, 1024, device=cuda_device)
    assert baseline_timer(lambda: x @ x) > 0

_THREADS = []

def test_one_cpu_thread(request):
    _THREADS.append(torch.get_num_threads())
    request.getfixturevalue("one_cpu_thread")
    assert torch.get_num_threads() == 1

def test_one_cpu_thread_is_restored():
    assert torch.get_num_threads() == _THREADS[0]
'''


def test_fixtures_and_gpu_skip(pytester, keep_hypothesis_profile):
    pytester.makepyfile(test_fixtures=FIXTURE_TESTS)
    result = pytester.runpytest(*_plugin_args(), "-rs")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=9)
    else:
        result.assert_outcomes(passed=5, skipped=4)
        result.stdout.fnmatch_lines(["*test_fixtures.py:*: no CUDA device*"])
        assert "SKIPPED [1] test_fixtures.py:17: no CUDA device" in result.stdout.str()


@pytest.mark.parametrize("capability, reason", [
    (None, "no CUDA device"),
    ((8, 9), "the megakernel runs on Hopper GPUs (sm_90) only; CUDA device 0 is sm_89"),
    ((10, 0), "the megakernel runs on Hopper GPUs (sm_90) only; CUDA device 0 is sm_100"),
    ((9, 0), None),
])
def test_hopper_skip_reason(capability, reason):
    assert plugin.hopper_skip_reason(capability) == reason


HOPPER_TESTS = '''
import pytest

@pytest.mark.gpu
@pytest.mark.hopper
def test_needs_the_kernel():
    pass

def test_plain():
    pass
'''


@pytest.mark.parametrize("capability", [None, (8, 0), (9, 0)])
def test_hopper_tests_skip_with_the_devices_capability(pytester, monkeypatch, keep_hypothesis_profile, capability):
    """A `hopper` test runs on sm_90 only and says why it was skipped elsewhere (an Ampere GPU: its capability;
    no GPU: no CUDA device); an unmarked test runs everywhere."""
    monkeypatch.setattr(plugin, "cuda_capability", lambda: capability)
    monkeypatch.setattr(plugin, "cuda_available", lambda: capability is not None)
    pytester.makepyfile(test_hopper=HOPPER_TESTS)
    result = pytester.runpytest(*_plugin_args(), "-rs")
    if capability == (9, 0):
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*test_hopper.py:*: " + plugin.hopper_skip_reason(capability) + "*"])


@pytest.mark.parametrize("env, expected", [
    ({}, "dev"),
    ({"CI": "true"}, "ci"),
    ({"CI": "false"}, "dev"),
    ({"CI": "1", "HYPOTHESIS_PROFILE": "fuzz"}, "fuzz"),
    ({"HYPOTHESIS_PROFILE": "ci"}, "ci"),
])
def test_hypothesis_profile_choice(env, expected):
    assert plugin.hypothesis_profile_name(env) == expected


@pytest.mark.parametrize("profile, max_examples, derandomize", [("ci", 10, True), ("dev", 50, False), ("fuzz", 5000, False)])
def test_profile_loaded_in_a_run(pytester, monkeypatch, keep_hypothesis_profile, profile, max_examples,
                                 derandomize):
    monkeypatch.setenv("HYPOTHESIS_PROFILE", profile)
    pytester.makepyfile(test_profile=f'''
from hypothesis import settings
def test_profile():
    assert settings.default.max_examples == {max_examples}
    assert settings.default.derandomize is {derandomize}
    assert settings.default.deadline is None
''')
    result = pytester.runpytest(*_plugin_args())
    result.assert_outcomes(passed=1)


def test_fuzz_examples_are_sized_by_the_environment(pytester, monkeypatch, keep_hypothesis_profile):
    """tools/gpu_run.sh fuzz sizes the fuzz profile to a device call; the other profiles keep their counts."""
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "fuzz")
    monkeypatch.setenv(plugin.FUZZ_EXAMPLES_ENV, "12")
    pytester.makepyfile(test_profile='''
from hypothesis import settings
def test_profile():
    assert settings.default.max_examples == 12 and settings.default.derandomize is False
    assert settings.get_profile("ci").max_examples == 10
''')
    result = pytester.runpytest(*_plugin_args())
    result.assert_outcomes(passed=1)


def test_unknown_profile_is_a_usage_error(pytester, monkeypatch, keep_hypothesis_profile):
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "nightly")
    pytester.makepyfile(test_x="def test_x(): pass")
    result = pytester.runpytest(*_plugin_args())
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "HYPOTHESIS_PROFILE='nightly'" in result.stderr.str()


def test_plugin_registered_once(request):
    """Loaded by the entry point or by the root conftest, never both."""
    pm = request.config.pluginmanager
    assert sum(1 for p in pm.get_plugins() if p is plugin) == 1


def test_markers_registered(request):
    lines = request.config.getini("markers")
    for name in plugin.MARKERS:
        assert any(line.startswith(f"{name}:") for line in lines), name


# -- tolerances ------------------------------------------------------------------------------------------

def test_tolerance_table_orders_dtypes_by_precision():
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    for finer, coarser in zip(order, order[1:]):
        assert TOLERANCES[finer].atol < TOLERANCES[coarser].atol
        assert TOLERANCES[finer].rtol < TOLERANCES[coarser].rtol
    with pytest.raises(ValueError, match="int8"):
        tolerance_for(torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_assert_close_against_float64(dtype):
    seed = 21
    ref = torch.randn(64, 33, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert_close(ref.to(dtype), ref, context=f"seed={seed}")    # rounding to dtype is within its tolerance
    off = ref.to(dtype).clone()
    off[3, 5] += 10 * tolerance_for(dtype).atol + 10 * tolerance_for(dtype).rtol * abs(float(ref[3, 5]))
    with pytest.raises(AssertionError, match=f"seed={seed}: dtype={dtype}"):
        assert_close(off, ref, context=f"seed={seed}")
    poisoned = ref.to(dtype).clone()
    poisoned[0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(poisoned, ref)


# -- strategies ------------------------------------------------------------------------------------------

@given(shape=decode_shapes(hidden_multiple=256, max_hidden=2048, max_batch=8, max_seq_len=100, block_size=16))
def test_decode_shapes_within_limits(shape):
    assert shape.hidden_size % 256 == 0 and 256 <= shape.hidden_size <= 2048
    assert shape.intermediate_size % 256 == 0
    assert shape.head_dim in (64, 128)
    assert shape.num_heads % shape.num_kv_heads == 0 and shape.gqa_group in (1, 2, 4, 8)
    assert 1 <= shape.batch <= 8 and len(shape.kv_lens) == shape.batch
    assert all(1 <= n <= 100 for n in shape.kv_lens)
    assert shape.positions == tuple(n - 1 for n in shape.kv_lens)
    assert shape.blocks_per_seq * shape.block_size >= shape.max_seq_len
    cfg = shape.to_config("Qwen3ForCausalLM")
    assert cfg.qk_norm and cfg.q_size == shape.num_heads * shape.head_dim
    assert cfg.max_position_embeddings == shape.max_seq_len


@pytest.mark.parametrize("target", [1, 15, 16, 17, 32, 33, 100])
def test_kv_lengths_reach_the_edges(target):
    assert find(kv_lengths(100, 16), lambda n: n == target) == target


def test_strategy_edges():
    assert find(rope_positions(4096), lambda p: p == 4095) == 4095
    assert find(rope_positions(4096), lambda p: p == 0) == 0
    assert find(decode_shapes(max_hidden=512), lambda s: s.hidden_size == 512).hidden_size == 512
    assert find(decode_shapes(), lambda s: s.batch == 8 and s.gqa_group == 8).batch == 8
    assert find(seeds(), lambda s: s > 2**30) > 2**30
    with pytest.raises(ValueError, match="max_seq_len"):
        kv_lengths(0)


THRESHOLD_TESTS = '''
import pytest

def test_thresholds(perf_thresholds, nvtx_range):
    gpu = "Some GPU"
    assert perf_thresholds.table(gpu) == {"floor_fraction": {"model-a": {"1": 0.5, "8": 0.25}}}
    assert perf_thresholds.limit(gpu, "floor_fraction", "model-a", 8) == 0.25
    assert perf_thresholds.table("Other GPU") is None
    assert perf_thresholds.failures("Other GPU", {"floor_fraction": 0.01}, "model-a", 1) == []
    assert perf_thresholds.failures(gpu, {"floor_fraction": 0.6, "speedup_x": 0.1}, "model-a", 1) == []
    assert perf_thresholds.failures(gpu, {"floor_fraction": 0.4}, "model-a", 1) == ["floor_fraction 0.400 < 0.5"]
    with pytest.raises(AssertionError, match="floor_fraction 0.200 < 0.25"):
        perf_thresholds.check(gpu, {"floor_fraction": 0.2}, "model-a", 8)
    with nvtx_range("a timed region"):
        pass
'''

THRESHOLDS_TOML = '["Some GPU".floor_fraction]\n"model-a" = { 1 = 0.5, 8 = 0.25 }\n'


@pytest.mark.parametrize("how", ["ini", "option", "option over ini"])
def test_perf_thresholds_fixture_reads_the_file_named_by_ini_or_option(pytester, keep_hypothesis_profile, how):
    """Another project names its thresholds file in its ini (megakernel_perf_thresholds, relative to the
    rootdir) or with --perf-thresholds PATH (which wins); the fixture checks ratios against it per GPU."""
    pytester.makefile(".toml", thresholds=THRESHOLDS_TOML)
    pytester.makefile(".toml", other='["Some GPU".floor_fraction]\n"model-a" = { 1 = 9.0 }\n')
    pytester.makepyfile(test_thresholds=THRESHOLD_TESTS)
    args = []
    if how in ("ini", "option over ini"):
        pytester.makeini("[pytest]\nmegakernel_perf_thresholds = " + ("other.toml" if how != "ini" else "thresholds.toml"))
    if how != "ini":
        args = ["--perf-thresholds", str(pytester.path / "thresholds.toml")]
    result = pytester.runpytest(*_plugin_args(), *args)
    result.assert_outcomes(passed=1)


def test_perf_thresholds_without_a_file_enforce_nothing_and_a_missing_file_is_an_error(pytester,
                                                                                      keep_hypothesis_profile):
    pytester.makepyfile(test_none='''
def test_none(perf_thresholds):
    assert perf_thresholds.path is None and perf_thresholds.failures("Some GPU", {"floor_fraction": 0.0}, "m", 1) == []
''')
    pytester.runpytest(*_plugin_args()).assert_outcomes(passed=1)
    result = pytester.runpytest(*_plugin_args(), "--perf-thresholds", "missing.toml")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*perf thresholds file*missing.toml does not exist*"])

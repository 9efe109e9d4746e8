"""The timing tests report through pytest-benchmark (part of the `test` extra); where it is not installed,
a stand-in `benchmark` fixture skips them with the reason instead of erroring on a missing fixture."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("pytest_benchmark") is None:
    @pytest.fixture
    def benchmark():
        pytest.skip("pytest-benchmark is not installed (pip install -e '.[test]')")

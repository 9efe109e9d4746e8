"""The GPU tools under tools/ explain themselves on --help and refuse a missing argument with their usage
line, on a machine without a GPU (before any weights are made or a device is touched)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# tool -> (words its --help shows, argument lists it must refuse; None: it has no required argument)
TOOLS = {
    "gpu_sweep.py": ("Usage: gpu_sweep.py MODEL BATCH", [[], ["llama-3.2-1b"], ["llama-3.2-1b", "one"]]),
    "gpu_profile.py": ("Usage (GPU host): python3 tools/gpu_profile.py MODEL BATCH OUT_DIR",
                       [[], ["llama-3.2-1b", "1"]]),
    "gpu_trace.py": ("python3 tools/gpu_trace.py MODEL [BATCH]", [[], ["llama-3.2-1b", "b"]]),
    "gpu_diag.py": ("Usage: gpu_diag.py MODEL BATCH", [[], ["llama-3.2-1b"]]),
    "ncu_step.py": ("python3 tools/ncu_step.py MODEL BATCH", [[], ["llama-3.2-1b"]]),
    "gpu_smoke.py": ("python3 tools/gpu_smoke.py [PRESET ...]", None),
}


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / tool), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_explains_itself_and_refuses_missing_arguments(tool):
    words, refused = TOOLS[tool]
    shown = _run(tool, "--help")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert words in shown.stdout, shown.stdout
    for args in refused or []:
        got = _run(tool, *args)
        assert got.returncode != 0, f"{tool} {args}: accepted"
        assert f"usage: {tool}" in got.stderr and "Traceback" not in got.stderr, got.stderr[-2000:]

"""A kernel error inside vLLM's serving loop (tools/vllm_error_path.py, on the GPU host; markers `gpu`, `hopper`,
`vllm`, `slow`): with the decode steps running as CUDA-graph replays, an aborted launch is noticed within a few
steps through the host flag, without a device sync per step, vLLM's step raises the kernel's error, and the
adapter stops using the megakernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "vllm_error_path.py")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.vllm
@pytest.mark.slow
def test_a_kernel_error_in_vllm_is_raised_within_a_few_steps_and_switches_the_path_off(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import vllm_error_path as tool

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, TOOL, "--preset", "llama-3.2-1b", "--out", str(out),
                           "--models", str(tmp_path / "models")], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
    path = out / "vllm_error_path_llama-3.2-1b.json"
    assert path.exists(), f"no report (exit {proc.returncode}):\n{tail}"
    r = json.loads(path.read_text())
    assert r["before"]["captured"] and 1 in r["engines"], f"the first generation did not run the megakernel: {r}"
    assert len(r["first_tokens"]) == 16
    assert r["raised"] is not None, f"the generation after the poisoned queue finished without an error: {r}"
    assert tool.KERNEL_MESSAGE in r["raised"], r["raised"][-1500:]
    assert r["disabled"] and all(d and tool.KERNEL_MESSAGE in d for d in r["disabled"]), r["disabled"]
    assert 1 <= r["checks_until_raise"] <= tool.MAX_CHECKS, \
        f"{r['checks_until_raise']} flag checks (steps) ran between the failed launch and the raise"
    # one timed-out wait (2 s) and a few steps, not a timeout per counter and step
    assert r["seconds_to_raise"] < 30, r["seconds_to_raise"]
    assert r["ok"] and proc.returncode == 0, tail

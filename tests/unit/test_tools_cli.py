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
    "gpu_diag.py": ("Usage: gpu_diag.py MODEL BATCH", [[], ["llama-3.2-1b"], ["llama-3.2-1b", "1", "--runs=x"]]),
    "ncu_step.py": ("python3 tools/ncu_step.py MODEL BATCH [OPTIONS]",
                    [[], ["llama-3.2-1b"], ["llama-3.2-1b", "1", "no_such_option=1"]]),
    "gpu_smoke.py": ("python3 tools/gpu_smoke.py [PRESET ...]", None),
    "activation_precision.py": ("Usage: python3 tools/activation_precision.py", [["--presets=no-such-preset"],
                                                                                 ["--steps=many"]]),
    "ncu_stalls.py": ("Usage: python3 tools/ncu_stalls.py NAME_sass.csv", [[], ["no_such_report.csv"]]),
    "atomics_bench.py": ("Usage: python3 tools/atomics_bench.py [--reps=R]", [["--reps=x"], ["--reps=0"]]),
    "cluster_fit.py": ("Usage: python3 tools/cluster_fit.py [--threads=T]", [["--threads=x"], ["--threads=0"]]),
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


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_refuses_a_flag_it_does_not_take(tool):
    """A flag the tool does not take (a misspelt one would otherwise change nothing, silently) stops it with its
    usage line and the flag named, before any weights are made or a device is touched."""
    got = _run(tool, "--no-such-flag=1")
    assert got.returncode != 0, f"{tool}: accepted --no-such-flag"
    assert f"usage: {tool}" in got.stderr and "no flag '--no-such-flag=1'" in got.stderr, got.stderr[-2000:]
    assert "Traceback" not in got.stderr, got.stderr[-2000:]


def test_ncu_stalls_reads_a_source_page(tmp_path):
    """tools/ncu_stalls.py on a source page in Nsight Compute's CSV form: the stall shares, the groups of
    instructions by execution count (a loop) and the top instruction, from made-up counts."""
    header = ["Address", "Source", "# Samples", "Instructions Executed", "stall_barrier", "stall_wait",
              "stall_barrier (Not Issued)"]
    rows = [["0x10", "LDS R2, [UR17+0x4]", "60", "10", "60", "0", "60"],
            ["0x20", "IMAD R4, R4, 0xf, RZ", "30", "1000", "0", "30", "0"],
            ["0x30", "LOP3.LUT R5, R4, 0xffff", "10", "1000", "0", "10", "0"]]
    path = tmp_path / "k_sass.csv"
    path.write_text("\n".join(",".join(f'"{v}"' for v in r) for r in [["Kernel Name", "k"], header, *rows]) + "\n")
    got = _run("ncu_stalls.py", str(path), "--top=1", "--sms=2")
    assert got.returncode == 0, got.stderr
    out = got.stdout
    assert "2,010 warp instructions executed (1,005 per SM); 100 stall samples" in out, out
    assert "barrier               60.0%" in out and "wait                  40.0%" in out, out
    assert "ran        1,000 times:    2 instructions,  99.5% of executed,  40.0% of samples" in out, out
    top = out.split("most samples:")[1]
    assert "LDS R2" in top and "IMAD" not in top, out


def test_gpu_experiment_applies_a_parked_patch_and_lists_its_sweeps(tmp_path):
    """tools/gpu_experiment.sh --dry-run: the patch applies to a copy of this tree (which stays as it is) and
    the sweeps and tests its header lists are what would run; a missing patch or one without any exits 2 with
    usage."""
    def run(*args):
        return subprocess.run(["bash", str(REPO / "tools" / "gpu_experiment.sh"), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    patch = tmp_path / "probe.patch"
    patch.write_text("A probe (its header names its sweeps):\n"
                     "  python3 tools/gpu_sweep.py tiny-llama 1 default: t:trace=1 --no-trace\n"
                     "  python3 tools/gpu_sweep.py tiny-qwen3 2 default: --no-trace\n"
                     "  PROBE_SETTING=4 python3 tools/gpu_sweep.py tiny-llama 8 default: --no-trace\n"
                     "  python3 -m pytest -m gpu -q tests/unit/test_stages.py -k probe\n"
                     "  python3 tools/sanitize.py --tools=racecheck --batches=1\n"
                     "  not python3 tools/gpu_sweep.py tiny-llama 4: a sentence that mentions one\n\n"
                     "diff --git a/probe_note.txt b/probe_note.txt\nnew file mode 100644\n--- /dev/null\n"
                     "+++ b/probe_note.txt\n@@ -0,0 +1 @@\n+probe\n")
    got = run(str(patch), "--dry-run")
    assert got.returncode == 0, got.stderr
    lines = [l.strip() for l in got.stdout.splitlines() if "python3 tools/" in l or "python3 -m" in l]
    assert len(lines) == 5 and "t:trace=1" in lines[0] and "tiny-qwen3" in lines[1], got.stdout
    assert lines[2].startswith("PROBE_SETTING=4 python3"), got.stdout     # (a sweep in its own environment)
    assert lines[3].startswith("python3 -m pytest -m gpu"), got.stdout    # (the patch's own GPU tests, in order)
    assert lines[4] == "python3 tools/sanitize.py --tools=racecheck --batches=1", got.stdout
    got = run(str(patch), "--only=2", "--dry-run")
    lines = [l.strip() for l in got.stdout.splitlines() if l.strip().startswith("python3 tools/gpu_sweep.py")]
    assert got.returncode == 0 and len(lines) == 1 and "tiny-qwen3" in lines[0], got.stdout + got.stderr
    for bad in ("--only=6", "--only=0", "--only=x", "--frobnicate"):
        got = run(str(patch), bad, "--dry-run")
        assert got.returncode == 2 and "usage: gpu_experiment.sh" in got.stderr, (bad, got.stderr)
    assert not (REPO / "probe_note.txt").exists()
    conflicting = tmp_path / "conflicting.patch"
    conflicting.write_text(patch.read_text().replace("probe_note.txt", "README.md"))   # (README.md exists)
    got = run(str(conflicting))
    assert got.returncode == 2 and "does not apply" in got.stderr, got.stderr
    missing = run(str(tmp_path / "none.patch"))
    assert missing.returncode == 2 and "usage: gpu_experiment.sh" in missing.stderr, missing.stderr
    empty = tmp_path / "empty.patch"
    empty.write_text("no sweep here\n")
    got = run(str(empty))
    assert got.returncode == 2 and "lists no" in got.stderr, got.stderr


def test_activation_precision_measures_the_hi_lo_split_closer_than_bf16():
    """tools/activation_precision.py on tiny-llama: teacher-forced on the float32 run's tokens, inputs rounded to
    bf16 move the logits more than a float32 input split into bf16 hi + lo, and neither is zero (the rounding took
    effect)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tools_activation_precision",
                                                  REPO / "tools" / "activation_precision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.run("tiny-llama", steps=6, batch=2, seed=3)
    assert r["steps"] == 6 and r["batch"] == 2
    bf16, split = r["bf16"], r["hi+lo"]
    assert 0 < split["max_rel_logit_err"] < bf16["max_rel_logit_err"], r
    assert 0 < split["max_top5_logprob_diff"] < bf16["max_top5_logprob_diff"], r
    assert bf16["of_which_ties"] <= bf16["greedy_differs_at"]


@pytest.mark.parametrize("patch", sorted(p.name for p in (REPO / "profiles" / "experiments").glob("*.patch")))
def test_every_parked_experiment_applies_to_this_tree_and_lists_what_it_runs(patch):
    """A parked patch (profiles/experiments) is only worth keeping while it applies: gpu_experiment.sh --dry-run
    applies it to a copy of this tree and lists at least one sweep or test from its header."""
    got = subprocess.run(["bash", str(REPO / "tools" / "gpu_experiment.sh"),
                          str(REPO / "profiles" / "experiments" / patch), "--dry-run"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "the patch applies; would run:" in got.stdout and "python3 " in got.stdout, got.stdout

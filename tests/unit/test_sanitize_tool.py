"""tools/sanitize.py: its reading of compute-sanitizer's report (on the CPU), and on a Hopper GPU with
compute-sanitizer the four tools over the megakernel with no kernel error."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("tools_sanitize", REPO / "tools" / "sanitize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


CLEAN_BUT_PROBED = """\
========= COMPUTE-SANITIZER
workload: tiny-llama batch 1: 3 steps, tokens [7]
========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "named symbol not found" on CUDA API call to cuGetProcAddress.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2f1e3] in libcuda.so.1
=========
========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "named symbol not found" on CUDA API call to cuGetProcAddress.
=========     Saved host backtrace up to driver entry point at error
=========
========= ERROR SUMMARY: 2 errors
"""

KERNEL_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at kernel_cutlass_decode+0x1a30
=========     by thread (33,0,0) in block (5,0,0)
=========     Address 0x7f0000000010 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f1e3] in libcuda.so.1
=========
========= Error: Race reported between Write access at kernel+0x200 in stage.py:88
=========     and Read access at kernel+0x480 in matvec.py:201 [128 hazards]
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
=========
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""


def test_report_tells_host_api_errors_from_kernel_errors(sanitize):
    clean = sanitize.report_errors(CLEAN_BUT_PROBED)
    assert clean.summary == 2 and clean.api_errors == {"cuGetProcAddress": 2} and clean.kernel_errors == []
    bad = sanitize.report_errors(KERNEL_ERRORS)
    assert bad.summary == 3 and bad.api_errors == {"cudaStreamSynchronize": 1}
    assert bad.kernel_errors == ["Invalid __global__ read of size 16 bytes",
                                 "Error: Race reported between Write access at kernel+0x200 in stage.py:88"]
    assert sanitize.report_errors("no sanitizer here").summary is None


RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
workload: tiny-qwen3 batch 3: 3 steps, tokens [1, 2, 3]
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

RACECHECK_HAZARD = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at kernel_cutlass_decode+0x200
=========     and Read access at kernel_cutlass_decode+0x480 [32 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_racecheck_summary_is_its_count_not_a_record(sanitize):
    """racecheck closes with its own summary line (the form a clean run printed on the H200, 2026-12-02)."""
    clean = sanitize.report_errors(RACECHECK_CLEAN)
    assert clean.summary == 0 and clean.kernel_errors == [] and clean.api_errors == {}
    bad = sanitize.report_errors(RACECHECK_HAZARD)
    assert bad.summary == 1 and bad.kernel_errors == ["Error: Race reported between Write access at "
                                                      "kernel_cutlass_decode+0x200"]


RACECHECK_BY_WORKLOAD = """\
========= COMPUTE-SANITIZER
workload: tiny-llama batch 16: building the engine
workload: tiny-llama batch 16: 1 steps, tokens [5]
workload: tiny-llama batch 16 on 8 SMs: building the engine
========= Error: Potential WAR hazard detected at __shared__ 0x7098 in block (3,0,0) :
=========     Read Thread (32,0,0) at 0x4a10 in kernel_cutlass_decode
=========     Write Thread (256,0,0) at 0x9f00 in kernel_cutlass_decode
=========     Current Value : 0, Incoming Value : 7
=========
========= Error: Potential WAR hazard detected at __shared__ 0x7099 in block (3,0,0) :
=========     Read Thread (33,0,0) at 0x4a10 in kernel_cutlass_decode
=========
========= Program hit cudaErrorLaunchFailure (error 719) on CUDA API call to cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point
=========
workload: tiny-qwen3 batch 16: building the engine
========= Error: Potential RAW hazard detected at __shared__ 0x10 in block (0,0,0) :
=========     Write Thread (0,0,0) at 0x100 in kernel_cutlass_decode
=========
========= Error: Potential RAW hazard detected at __shared__ 0x11 in block (0,0,0) :
=========
========= RACECHECK SUMMARY: 4 hazards displayed (4 errors, 0 warnings)
"""


def test_kernel_errors_are_counted_by_workload_and_the_first_shown_whole(sanitize):
    """Each kernel error goes to the engine whose "building the engine" line came last before it; the first
    RECORDS_SHOWN records keep their indented lines (threads, accesses), an API error's lines are not taken."""
    rep = sanitize.report_errors(RACECHECK_BY_WORKLOAD)
    assert rep.summary == 4 and rep.api_errors == {"cudaStreamSynchronize": 1} and len(rep.kernel_errors) == 4
    assert rep.by_workload == {"tiny-llama batch 16 on 8 SMs": 2, "tiny-qwen3 batch 16": 2}
    assert sanitize.RECORDS_SHOWN == 3 and len(rep.first_records) == 3
    first = rep.first_records[0].splitlines()
    assert first[0] == ("[tiny-llama batch 16 on 8 SMs] Error: Potential WAR hazard detected at __shared__ 0x7098 "
                        "in block (3,0,0) :")
    assert [line.strip() for line in first[1:]] == ["Read Thread (32,0,0) at 0x4a10 in kernel_cutlass_decode",
                                                    "Write Thread (256,0,0) at 0x9f00 in kernel_cutlass_decode",
                                                    "Current Value : 0, Incoming Value : 7"]
    assert rep.first_records[1].splitlines()[1:] == ["    Read Thread (33,0,0) at 0x4a10 in kernel_cutlass_decode"]
    assert rep.first_records[2].splitlines() == ["[tiny-qwen3 batch 16] Error: Potential RAW hazard detected at "
                                                 "__shared__ 0x10 in block (0,0,0) :",
                                                 "    Write Thread (0,0,0) at 0x100 in kernel_cutlass_decode"]


def test_bad_arguments_exit_2_before_any_gpu_work(tmp_path):
    for argv in (["--tools=memcheck,valgrind"], ["--steps=0"], ["--frobnicate"],
                 [f"--log-dir={tmp_path / 'absent'}"]):
        done = subprocess.run([sys.executable, str(REPO / "tools" / "sanitize.py"), *argv], capture_output=True,
                              text=True)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert "usage: sanitize.py" in done.stderr, (argv, done.stderr)


FAKE_SANITIZER = """#!/bin/sh
# stands in for compute-sanitizer: the workload's lines for the first $FAKE_FINISHED of its four engines at batch 1
# (tiny-llama, tiny-llama on 8 SMs, tiny-qwen3, tiny-llama from position 200: each announced, then reported), and a
# clean summary
echo "========= COMPUTE-SANITIZER"
n=0
for engine in "tiny-llama batch 1" "tiny-llama batch 1 on 8 SMs" "tiny-qwen3 batch 1" \
              "tiny-llama batch 1 from position 200"; do
  echo "workload: $engine: building the engine"
  n=$((n + 1))
  [ "$n" -le "$FAKE_FINISHED" ] && echo "workload: $engine: 3 steps, tokens [7]"
done
echo "========= ERROR SUMMARY: 0 errors"
"""


@pytest.mark.parametrize("finished", [4, 1])
def test_progress_is_echoed_per_tool_and_an_unfinished_workload_fails(tmp_path, finished):
    """A tool's workload lines come out as they arrive, tagged with the tool and its seconds; the run passes only
    where every engine of the workload reported its tokens (a workload that died after one of four fails, even
    with a clean summary)."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_FINISHED": str(finished), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "sanitize.py"), "--tools=memcheck", "--batches=1"],
                          capture_output=True, text=True, env=env, timeout=300)
    progress = [l for l in done.stdout.splitlines() if l.startswith("  [memcheck ")]
    assert len(progress) == 4 + finished and "building the engine" in progress[0], done.stdout + done.stderr
    assert all(" s] workload: " in l for l in progress), done.stdout
    assert f"done: {finished} of 4 workloads, 0 kernel errors" in done.stdout, done.stdout
    assert done.returncode == (0 if finished == 4 else 1), done.stdout + done.stderr


def test_log_dir_keeps_each_tools_whole_output(tmp_path):
    """--log-dir=DIR: the tool's whole output (the workload's lines and the sanitizer's) in DIR/sanitize_TOOL.log."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_FINISHED": "4", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "sanitize.py"), "--tools=racecheck", "--batches=1",
                           f"--log-dir={logs}"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["sanitize_racecheck.log"]
    kept = (logs / "sanitize_racecheck.log").read_text()
    assert kept.startswith("========= COMPUTE-SANITIZER\n") and kept.count("workload: ") == 8, kept
    assert kept.rstrip().endswith("========= ERROR SUMMARY: 0 errors"), kept
    assert f"its whole output: {logs / 'sanitize_racecheck.log'}" in done.stdout, done.stdout


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.sanitizer
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck", "initcheck"])
def test_compute_sanitizer_finds_no_kernel_error(sanitize, tool):
    """Each tool over a few steps of the tiny presets at batch 1, 3 and 16, and tiny-llama at batch 1 on a long cache
    (its own test: one tool took 35 s to over 170 s on an H100, so a GPU call can run them one by one, `-k
    racecheck`)."""
    assert tool in sanitize.TOOLS
    if sanitize.sanitizer_path() is None:
        pytest.skip("compute-sanitizer not found")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "sanitize.py"), f"--tools={tool}"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_few_sm_workloads_reuse_every_ring_slot(sanitize):
    """The workload's engines on few SMs are there so that racecheck sees a ring slot's reads released before its
    next copy: in each of them every CTA takes more weight slots a step than its ring holds (the engine's own
    layout, schedule and slot geometry, at batch 1-8 and past SPLIT_BATCH)."""
    from megakernel.instructions.layout import StepLayout, default_kv_splits
    from megakernel.instructions.matvec_stages import MATVEC_OPCODES
    from megakernel.kernel.compile import device_code
    from megakernel.model.presets import get_preset
    from megakernel.schedule import assign, build_program

    few = [(name, batch, sms) for name, batch, sms, _ in sanitize.workload_plan(sanitize.BATCHES) if sms is not None]
    assert sorted(batch for _, batch, _ in few) == sorted(sanitize.BATCHES), few
    for name, batch, sms in few:
        config = get_preset(name)
        cache = sanitize.CACHE_PAST_START                                 # (the engine's, from position 0)
        layout = StepLayout(config=config, batch=batch, kv_splits=default_kv_splits(config, batch, sms, cache),
                            block_size=16, max_blocks_per_seq=cache // 16, num_sms=sms)
        program = build_program(layout)
        queues = assign(program, "balanced")
        kernel = device_code(layout, program)
        slots = []
        for queue in queues:
            n = 0
            for ins in queue:
                if ins.opcode in MATVEC_OPCODES:
                    n += kernel.plan.geometry(kernel.tile_k(ins)).slots(ins.a1)
            slots.append(n)
        assert min(slots) > kernel.ring_slots, (name, batch, sms, kernel.ring_slots, slots)


def test_the_long_cache_workload_takes_the_tensor_core_pass_on_every_split(sanitize):
    """The workload's engine from LONG_CONTEXT is there so that each tool covers the attention's tensor-core pass:
    at each of its steps every KV split of the engine's own layout (its cache, the GPU's 132 SMs) holds more cached
    positions than the consumer warps (softmax_pass.long_split); only batch 1 of the batches brings it."""
    from megakernel.instructions.attention import split_range
    from megakernel.instructions.layout import StepLayout, default_kv_splits
    from megakernel.kernel.compile import device_code
    from megakernel.model.presets import get_preset
    from megakernel.schedule import build_program

    long = [(name, batch, sms, start) for name, batch, sms, start in sanitize.workload_plan(sanitize.BATCHES) if start]
    assert long == [(sanitize.PRESETS[0], 1, None, sanitize.LONG_CONTEXT)], long
    assert not any(start for *_, start in sanitize.workload_plan((3, 16)))
    config = get_preset(sanitize.PRESETS[0])
    cache = -(-(sanitize.LONG_CONTEXT + sanitize.CACHE_PAST_START) // 16) * 16    # (the engine's, in whole blocks)
    splits = default_kv_splits(config, 1, 132, cache)
    layout = StepLayout(config=config, batch=1, kv_splits=splits, block_size=16, max_blocks_per_seq=cache // 16,
                        num_sms=132)
    warps = device_code(layout, build_program(layout)).warps
    for pos in range(sanitize.LONG_CONTEXT, sanitize.LONG_CONTEXT + sanitize.STEPS):
        lengths = [hi - lo for lo, hi in (split_range(pos, s, splits) for s in range(splits))]
        assert min(lengths) > warps, (pos, splits, lengths, warps)

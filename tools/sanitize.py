"""compute-sanitizer over the megakernel: memcheck, racecheck, synccheck and initcheck, each over a few decode steps
of the tiny presets at batch 1, 3 and 16 (the last past SPLIT_BATCH: wgmma, the pre-staged inputs' bulk copies and
their mbarrier), the first preset also on few SMs (where each CTA reuses its weight-ring slots) and at batch 1 with
a long cache (every KV split on the attention's tensor-core pass), and a table of the errors each found in the
kernel.

Usage (GPU host, compute-sanitizer on PATH or in $CUDA_HOME/bin):
    python3 tools/sanitize.py [--tools=memcheck,racecheck,synccheck,initcheck] [--steps=N] [--batches=1,3,16]
                              [--log-dir=DIR]
A tool that reports kernel errors is shown with its errors counted by workload engine and its first few error
records whole (the threads and accesses of a race); --log-dir=DIR keeps each tool's whole output in
DIR/sanitize_TOOL.log.
Exit status 1 where any tool reports a kernel error, 2 for bad arguments or no compute-sanitizer.

How kernel errors are told apart from host API errors: compute-sanitizer also reports every CUDA API call that
returned an error, and the driver probes its entry points (cuGetProcAddress returning CUDA_ERROR_NOT_FOUND for a
symbol this driver lacks) while torch and the CuTe DSL runtime start. Those records read "Program hit <error> ... on
CUDA API call to <function>"; `report_errors` counts them apart (by function) from every other record, which is
an error of device code: an invalid or misaligned access, a shared-memory race, a barrier misuse, a read of
uninitialised memory. Only the latter fail the run.

The workload (`--workload`, what each tool runs) builds the engine with a long bound on its waits: under a
sanitizer the CTAs run far slower, and a wait bounded by the default 2 s would end in the error word while the
producing CTA is still on its way.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
STEPS = 3
PRESETS = ("tiny-llama", "tiny-qwen3")
BATCHES = (1, 3, 16)
RING_REUSE_SMS = 8                       # SMs at which every CTA's share of a tiny preset reuses its ring slots
WAIT_BOUND_NS = 600_000_000_000          # 10 minutes: no wait may end before a slow CTA signals
LONG_CONTEXT = 200                       # the long-cache engine's first position: each of its KV splits is longer
                                         # than the consumer warps (the tensor-core pass: softmax_pass.long_split)
CACHE_PAST_START = 64                    # positions each engine's cache holds from its first position on
USAGE = ("sanitize.py [--tools=memcheck,racecheck,synccheck,initcheck] [--steps=N] [--batches=1,3,16] "
         "[--log-dir=DIR]")

_RECORD = re.compile(r"^========= (?!COMPUTE-SANITIZER|Target application returned)(?P<text>\S.*)$")
_API = re.compile(r"Program hit .* on CUDA API call to (?P<call>\w+)")
# the closing count: "ERROR SUMMARY: N errors" (memcheck, synccheck, initcheck), "RACECHECK SUMMARY: N hazards
# displayed (E errors, W warnings)" (racecheck: N, every hazard counts)
_SUMMARY = re.compile(r"^========= (?:ERROR SUMMARY: (?P<n>\d+) errors?|RACECHECK SUMMARY: (?P<h>\d+) hazards?)")


_WORKLOAD = re.compile(r"^workload: (?P<what>.*?): building the engine")
RECORDS_SHOWN = 3            # kernel error records a failed tool's report shows whole (threads, accesses, backtrace)


@dataclass
class SanitizerReport:
    """What one compute-sanitizer run reported: the error summary's count, the API-call errors by function, the
    first line of every other error record (an error of device code), those errors counted by the workload engine
    that was running (its "building the engine" line the last before the record), and the first RECORDS_SHOWN of
    them whole."""

    summary: int | None
    api_errors: dict[str, int] = field(default_factory=dict)
    kernel_errors: list[str] = field(default_factory=list)
    by_workload: dict[str, int] = field(default_factory=dict)
    first_records: list[str] = field(default_factory=list)


def report_errors(output: str) -> SanitizerReport:
    """Parse compute-sanitizer's output. An error record starts with a '========= ' line that is not indented
    (its indented lines are the record's details: addresses, threads, the backtrace); one that reads 'Program
    hit ... on CUDA API call to F' is a host API error of F, any other a kernel error (the banner and the
    'Target application returned an error' line are no records)."""
    summary = None
    api: dict[str, int] = {}
    kernel: list[str] = []
    by_workload: dict[str, int] = {}
    records: list[list[str]] = []
    workload = "(before any workload)"
    open_record = False            # the last record is a kernel error still taking its indented lines
    for line in output.splitlines():
        m = _WORKLOAD.match(line)
        if m:
            workload = m.group("what")
            continue
        m = _SUMMARY.match(line)
        if m:
            summary = int(m.group("n") if m.group("n") is not None else m.group("h"))
            open_record = False
            continue
        m = _RECORD.match(line)
        if not m:
            if open_record and line.startswith("=========     "):
                records[-1].append(line[len("========= "):])
            continue
        text = m.group("text")
        call = _API.search(text)
        open_record = False
        if call:
            api[call.group("call")] = api.get(call.group("call"), 0) + 1
        else:
            kernel.append(text)
            by_workload[workload] = by_workload.get(workload, 0) + 1
            if len(records) < RECORDS_SHOWN:
                records.append([f"[{workload}] {text}"])
                open_record = True
    return SanitizerReport(summary=summary, api_errors=api, kernel_errors=kernel, by_workload=by_workload,
                           first_records=["\n".join(r) for r in records])


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "compute-sanitizer")):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


def workload_plan(batches: tuple[int, ...]) -> list[tuple[str, int, int | None, int]]:
    """(preset, batch, SMs or None for all, first position) of every engine the workload runs: each tiny preset at
    each batch from position 0, for the first preset also on few SMs, and where batch 1 is among the batches the
    first preset from LONG_CONTEXT (its cache filled with random values first), whose KV splits take the
    tensor-core pass. On all of a GPU's SMs a CTA's share of a tiny preset's weights is a slot or two, so no ring
    slot is ever used twice; on few SMs every CTA reuses each slot (the release of a slot's
    reads before its next copy is what racecheck then checks): RING_REUSE_SMS up to SPLIT_BATCH, past it a quarter
    as many SMs as (sequence, kv head) pairs, where an attention instruction also takes several sequences (at 16:
    4, two consumer warps each; at 41: 5, one each), which on all SMs it does not (CTA-wide items only)."""
    from megakernel.instructions.layout import SPLIT_BATCH
    from megakernel.model.presets import get_preset

    plan = []
    for name in PRESETS:
        for batch in batches:
            plan.append((name, batch, None, 0))
            if name == PRESETS[0]:
                few = RING_REUSE_SMS if batch <= SPLIT_BATCH else batch * get_preset(name).num_kv_heads // 4
                plan.append((name, batch, max(1, few), 0))
    if 1 in batches:
        plan.append((PRESETS[0], 1, None, LONG_CONTEXT))
    return plan


def workload(steps: int, batches: tuple[int, ...]) -> None:
    """A few checked decode steps of every engine of workload_plan (the engine raises on an error word), each
    announced before it is built and reported with its tokens after its steps."""
    import torch

    from megakernel.kernel.interpreter import KernelOptions
    from megakernel.model.presets import get_preset
    from megakernel.model.weights import random_weights
    from megakernel.runtime.engine import MegakernelEngine

    weights = {}
    for name, batch, num_sms, start in workload_plan(batches):
        if name not in weights:
            weights[name] = random_weights(get_preset(name), seed=5, dtype=torch.bfloat16, device="cuda")
        where = ("" if num_sms is None else f" on {num_sms} SMs") + (f" from position {start}" if start else "")
        print(f"workload: {name} batch {batch}{where}: building the engine", flush=True)
        eng = MegakernelEngine(weights[name], batch, start + CACHE_PAST_START, num_sms=num_sms,
                               options=KernelOptions(timeout_ns=WAIT_BOUND_NS))
        if start:
            # the positions before `start` as if earlier steps had cached them (written, so initcheck reads them
            # as set)
            gen = torch.Generator(device="cuda").manual_seed(start)
            for cache in (eng.k_cache, eng.v_cache):
                cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda"))
        tokens = torch.arange(batch, dtype=torch.int32, device="cuda") + 1
        for t in range(steps):
            tokens = eng.step(tokens, torch.full((batch,), start + t, dtype=torch.int32, device="cuda")).clone()
        print(f"workload: {name} batch {batch}{where}: {steps} steps, tokens {tokens.tolist()}", flush=True)
        del eng


def run_tool(tool: str, steps: int, batches: tuple[int, ...], sanitizer: str) -> tuple[SanitizerReport, int, str]:
    """One compute-sanitizer tool over the workload: (its report, the exit status, the output). The workload's
    progress lines are echoed as they come, with the tool and the seconds since it started (a tool takes minutes:
    a run cut short still shows how far each got)."""
    options = ["--racecheck-report", "hazard"] if tool == "racecheck" else []
    cmd = [sanitizer, "--tool", tool, *options, "--print-limit", "100", sys.executable, os.path.abspath(__file__),
           "--workload", f"--steps={steps}", "--batches=" + ",".join(map(str, batches))]
    t0 = time.monotonic()
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("workload:"):
                print(f"  [{tool} {time.monotonic() - t0:5.0f} s] {line.rstrip()}", flush=True)
    out = "".join(lines)
    return report_errors(out), proc.returncode, out


def usage_error(why: str) -> None:
    print(f"usage: {USAGE}  ({why}; --help explains)", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:
        print(__doc__.strip())
        sys.exit(0)
    steps = STEPS
    text = next((a.split("=", 1)[1] for a in args if a.startswith("--steps=")), None)
    if text is not None:
        if not text.isdigit() or int(text) < 1:
            usage_error(f"--steps takes a positive integer, not {text!r}")
        steps = int(text)
    batches = BATCHES
    text = next((a.split("=", 1)[1] for a in args if a.startswith("--batches=")), None)
    if text is not None:
        parts = text.split(",")
        if not all(x.isdigit() and 1 <= int(x) <= 64 for x in parts):
            usage_error(f"--batches takes batch sizes 1..64 separated by commas, not {text!r}")
        batches = tuple(int(x) for x in parts)
    if "--workload" in args:
        workload(steps, batches)
        return
    chosen = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--tools=")), list(TOOLS))
    unknown = [t for t in chosen if t not in TOOLS] + [
        a for a in args if not a.startswith(("--tools=", "--steps=", "--batches=", "--log-dir="))]
    if unknown:
        usage_error(f"unknown {', '.join(unknown)}; the tools are {', '.join(TOOLS)}")
    log_dir = next((a.split("=", 1)[1] for a in args if a.startswith("--log-dir=")), None)
    if log_dir is not None and not os.path.isdir(log_dir):
        usage_error(f"--log-dir takes an existing directory, not {log_dir!r}")
    sanitizer = sanitizer_path()
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer not found (on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)",
              file=sys.stderr)
        sys.exit(2)
    engines = len(workload_plan(batches))
    rows, details = [], []
    for tool in chosen:
        rep, rc, out = run_tool(tool, steps, batches, sanitizer)
        finished = len(re.findall(r"^workload: .* steps, tokens ", out, re.MULTILINE))
        bad = rep.kernel_errors or rep.summary is None or finished < engines
        api = ", ".join(f"{k} x{v}" for k, v in sorted(rep.api_errors.items())) or "-"
        rows.append(f"{tool:10s} {str(rep.summary):>8s} {len(rep.kernel_errors):7d}  {api}")
        print(f"  [{tool}] done: {finished} of {engines} workloads, {len(rep.kernel_errors)} kernel errors", flush=True)
        if log_dir is not None:
            path = os.path.join(log_dir, f"sanitize_{tool}.log")
            with open(path, "w") as f:
                f.write(out)
            print(f"  [{tool}] its whole output: {path}", flush=True)
        if bad:
            shown = [f"{n} kernel errors in {what}" for what, n in rep.by_workload.items()] + rep.first_records
            details.append(f"{tool}:\n" + ("\n".join(f"    {line}" for text in shown for line in text.splitlines())
                                           or out[-4000:]))
    print(f"{'tool':10s} {'summary':>8s} {'kernel':>7s}  host API errors (by call)")
    print("\n".join(rows + details), flush=True)
    failed = bool(details)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

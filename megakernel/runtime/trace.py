"""Export the kernel's trace mode (KernelOptions(trace=True)) as a Chrome / Perfetto trace: one track
per SM, one slice per instruction (its wait on the producing stage, then its work)."""

from __future__ import annotations

import json
from collections import defaultdict


def chrome_trace(records: list[dict], program, name: str = "megakernel step") -> dict:
    """records: MegakernelEngine.trace_records() -> a dict for json.dump (open in ui.perfetto.dev or
    chrome://tracing). Times are microseconds from the earliest instruction start."""
    t0 = min(r["begin"] for r in records)
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": name}}]
    for sm in sorted({r["sm"] for r in records}):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": sm, "args": {"name": f"SM {sm:3d}"}})
    for r in records:
        ins = program.instructions[r["index"]]
        label = f"{r['opcode']} L{ins.layer}" if r["opcode"] not in ("EMBED", "ARGMAX", "LM_HEAD") else r["opcode"]
        if r["ready"] > r["begin"]:
            events.append({"ph": "X", "pid": 0, "tid": r["sm"], "name": "wait", "cat": "wait",
                           "ts": (r["begin"] - t0) / 1e3, "dur": (r["ready"] - r["begin"]) / 1e3,
                           "args": {"instruction": r["index"], "counter": ins.wait_id}})
        events.append({"ph": "X", "pid": 0, "tid": r["sm"], "name": label, "cat": r["opcode"],
                       "ts": (r["ready"] - t0) / 1e3, "dur": max(r["end"] - r["ready"], 0) / 1e3,
                       "args": {"instruction": r["index"], "a0": ins.a0, "a1": ins.a1, "a2": ins.a2}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def stage_summary(records: list[dict]) -> list[dict]:
    """Per opcode: instruction count, mean wait and work in microseconds, and the step span."""
    by = defaultdict(list)
    for r in records:
        by[r["opcode"]].append(r)
    out = []
    for op, rs in by.items():
        out.append({"opcode": op, "count": len(rs),
                    "wait_us": sum(r["ready"] - r["begin"] for r in rs) / len(rs) / 1e3,
                    "work_us": sum(r["end"] - r["ready"] for r in rs) / len(rs) / 1e3})
    return out


def write_chrome_trace(path: str, records: list[dict], program, name: str = "megakernel step") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(records, program, name), f, separators=(",", ":"))

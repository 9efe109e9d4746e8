"""Where the warps of one kernel spend their time, from a Nsight Compute report's source page exported as CSV
(tools/gpu_ncu.sh writes it: NAME_sass.csv, from the SourceCounters section): the sampled stall reasons over
the whole kernel, the instructions grouped by how many times each ran (a loop body's instructions share a
count, so a group is a loop or a code path: its share of the executed instructions and of the samples), and
the instructions with the most samples, each with its top stall reasons.
Usage: python3 tools/ncu_stalls.py NAME_sass.csv [--top=N] [--sms=N]   (no GPU needed)"""
from __future__ import annotations

import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import int_flag, positional  # noqa: E402

USAGE = "ncu_stalls.py NAME_sass.csv [--top=N] [--sms=N]"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the source page: the first line names the kernel, the second is the header."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((r for r in rows[:3] if "# Samples" in r), None)
    if header is None:
        raise ValueError(f"{path}: no '# Samples' column (export the source page of a report with SourceCounters)")
    return header, [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]


def main() -> None:
    path = positional(__doc__, USAGE, 1, flags=("--top", "--sms"))[0]
    top, sms = int_flag("--top", 30, USAGE), int_flag("--sms", 132, USAGE)
    try:
        header, rows = load(path)
    except (OSError, ValueError) as e:
        sys.exit(f"usage: {USAGE}  ({e})")
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    samples = sum(number(r[col["# Samples"]]) for r in rows) or 1.0
    executed = sum(number(r[col["Instructions Executed"]]) for r in rows) or 1.0
    print(f"{len(rows)} instructions; {executed:,.0f} warp instructions executed ({executed / sms:,.0f} per SM); "
          f"{samples:,.0f} stall samples")
    print("stall reasons (share of samples):")
    totals = collections.Counter({s: sum(number(r[col[s]]) for r in rows) for s in reasons})
    for s, v in totals.most_common():
        if v:
            print(f"  {s[6:]:20s} {100 * v / samples:5.1f}%")
    print("instructions by execution count (a loop or a code path per line):")
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        n = number(r[col["Instructions Executed"]])
        g = groups[n]
        g[0] += 1
        g[1] += n
        g[2] += number(r[col["# Samples"]])
    for n, (count, ex, smp) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  ran {n:12,.0f} times: {count:4d} instructions, {100 * ex / executed:5.1f}% of executed, "
              f"{100 * smp / samples:5.1f}% of samples")
    print(f"the {top} instructions with the most samples:")
    for r in sorted(rows, key=lambda r: -number(r[col["# Samples"]]))[:top]:
        why = sorted(((number(r[col[s]]), s[6:]) for s in reasons), reverse=True)[:3]
        print(f"  {r[0][-6:]} {number(r[col['# Samples']]):8,.0f} ran {number(r[col['Instructions Executed']]):11,.0f}"
              f"  {r[1].strip()[:56]:56s} " + " ".join(f"{s}={v:,.0f}" for v, s in why if v))


if __name__ == "__main__":
    main()

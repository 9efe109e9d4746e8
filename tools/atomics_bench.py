"""The L2's rate for 64-bit integer atomic adds in the pattern of a split-K sum folded into its producers: N
contributors each adding one word to every one of H words (N x H atomics onto H addresses), against the same
number of atomics onto N x H distinct words and a plain copy of N x H words; and the fold's H words spread one to
each 32-byte L2 sector (stride 4 words), which asks whether its contention is the few sectors (and so slices) that
H packed words touch or the adds to one address. Each case is one launch (torch's
index_add_ on int64, which adds with atomics, and copy_) captured in a CUDA graph and replayed --reps times back to
back (megakernel.integrations.bench.time_cuda_graph, the benchmarks' own timer); the time per launch, fitted over
N = 16 .. 256, gives a slope (ns per 1,000 words) free of the launch's fixed cost, and the burst a step would pay
at N = 128 contributors for the presets' hidden sizes. Integer adds are associative, so such a sum has the same bits
in any order (the determinism the suite asks of every step), where float atomics do not.
Usage: python3 tools/atomics_bench.py [--reps=R] (GPU host)"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tools")
from toolargs import int_flag, positional  # noqa: E402

from megakernel.integrations.bench import time_cuda_graph  # noqa: E402

USAGE = "atomics_bench.py [--reps=R]"
positional(__doc__, USAGE, 0, flags=("--reps",))
REPS = int_flag("--reps", 50, USAGE)
CONTRIBUTORS = (16, 32, 64, 128, 256)
SECTOR_WORDS = 4           # int64 words in a 32-byte L2 sector
HIDDEN = {"qwen3-0.6b": 1024, "llama-3.2-1b": 2048, "llama-3.1-8b": 4096}
if not torch.cuda.is_available():
    sys.exit("atomics_bench.py: no CUDA device (run it on the GPU host)")


def per_launch_us(fn) -> float:
    """Median us per launch of fn, replayed REPS times from a CUDA graph."""
    return time_cuda_graph(fn, replays=REPS) * 1000


def slope_ns_per_1000(ns: list[int], us: list[float], h: int) -> float:
    """Least-squares slope of us against N x h words, in ns per 1,000 words."""
    words = torch.tensor([n * h for n in ns], dtype=torch.float64)
    t = torch.tensor(us, dtype=torch.float64)
    wc, tc = words - words.mean(), t - t.mean()
    return float((wc * tc).sum() / (wc * wc).sum()) * 1e6


def main():
    print(torch.cuda.get_device_name(), f"reps {REPS}")
    print(f"{'hidden':>6} {'N':>4} {'words':>8} {'onto H words':>13} {'a sector each':>14} {'onto N x H':>11} "
          f"{'copy':>8}   us per launch")
    for name, h in HIDDEN.items():
        rows = {"fold": [], "spread": [], "distinct": [], "copy": []}
        for n in CONTRIBUTORS:
            src = torch.randint(-2 ** 40, 2 ** 40, (n * h,), dtype=torch.int64, device="cuda")
            onto_h = torch.arange(h, device="cuda").repeat(n)        # contributor-major, as CTAs finish
            acc = torch.zeros(h, dtype=torch.int64, device="cuda")
            onto_spread = onto_h * SECTOR_WORDS                           # word j at 32-byte sector j
            acc_spread = torch.zeros(h * SECTOR_WORDS, dtype=torch.int64, device="cuda")
            wide = torch.zeros(n * h, dtype=torch.int64, device="cuda")
            every = torch.arange(n * h, device="cuda")
            dst = torch.empty_like(src)
            rows["fold"].append(per_launch_us(lambda: acc.index_add_(0, onto_h, src)))
            rows["spread"].append(per_launch_us(lambda: acc_spread.index_add_(0, onto_spread, src)))
            rows["distinct"].append(per_launch_us(lambda: wide.index_add_(0, every, src)))
            rows["copy"].append(per_launch_us(lambda: dst.copy_(src)))
            # the sum is the same in any order: integer adds (checked once per case, outside the timing)
            once = torch.zeros(h, dtype=torch.int64, device="cuda").index_add_(0, onto_h, src)
            again = torch.zeros(h, dtype=torch.int64, device="cuda").index_add_(0, onto_h.flip(0), src.flip(0))
            assert torch.equal(once, again), "integer atomics gave different sums in another order"
            print(f"{h:>6} {n:>4} {n * h:>8} {rows['fold'][-1]:>13.2f} {rows['spread'][-1]:>14.2f} "
                  f"{rows['distinct'][-1]:>11.2f} {rows['copy'][-1]:>8.2f}")
        slopes = {k: slope_ns_per_1000(list(CONTRIBUTORS), v, h) for k, v in rows.items()}
        print(f"  {name} (H = {h}): ns per 1,000 words: onto H {slopes['fold']:.1f}, a sector each "
              f"{slopes['spread']:.1f}, onto N x H {slopes['distinct']:.1f}, copy {slopes['copy']:.1f}; a burst of "
              f"128 x {h} atomics onto H words ~{slopes['fold'] * 128 * h / 1e6:.2f} us past the launch's fixed cost "
              f"(a sector each ~{slopes['spread'] * 128 * h / 1e6:.2f} us)")


if __name__ == "__main__":
    main()

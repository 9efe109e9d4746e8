"""Per-stage timing of one decode step from the kernel's trace mode: for each opcode, the mean time
instructions spent waiting on their counter and working, and the step's span.
Usage (GPU host): python3 tools/gpu_trace.py MODEL [BATCH]  (BATCH defaults to 1)"""
import os, sys, collections
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import positional  # noqa: E402
ARGS = positional(__doc__, "gpu_trace.py MODEL [BATCH]", 1, ints=(1,))
import torch
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine
from megakernel.kernel.interpreter import KernelOptions

name = ARGS[0]; B = int(ARGS[1]) if len(ARGS) > 1 else 1
cfg = get_preset(name)
w = random_weights(cfg, seed=3, device="cuda")
eng = MegakernelEngine(w, B, 256, options=KernelOptions(trace=True))
tok = torch.randint(0, cfg.vocab_size, (B,))
for s in range(40):
    eng.step(tok, torch.full((B,), s), check=False)
torch.cuda.synchronize(); eng.check()
recs = eng.trace_records()
t0 = min(r["begin"] for r in recs)
span = max(r["end"] for r in recs) - t0
by = collections.defaultdict(list)
for r in recs:
    by[r["opcode"]].append(r)
print(f"{name} B={B}: step span {span/1e3:.1f} us, {len(recs)} instructions")
for op, rs in by.items():
    wait = sum(r["ready"] - r["begin"] for r in rs) / len(rs)
    work = sum(r["end"] - r["ready"] for r in rs) / len(rs)
    print(f"  {op:13s} n={len(rs):5d} wait {wait/1e3:7.2f} us  work {work/1e3:7.2f} us")
# critical path of layer 1: when each stage's last instruction ended
L1 = [r for r in recs if r["index"] >= 0]
stages = collections.defaultdict(lambda: [1e18, 0])
for r in recs:
    k = r["opcode"]
    stages[k][0] = min(stages[k][0], r["ready"]); stages[k][1] = max(stages[k][1], r["end"])

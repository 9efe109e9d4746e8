"""Record one decode step in the kernel's trace mode and write a Chrome/Perfetto trace plus a stage
summary. Usage (GPU host): python3 tools/gpu_profile.py MODEL BATCH OUT_DIR"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import positional  # noqa: E402
ARGS = positional(__doc__, "gpu_profile.py MODEL BATCH OUT_DIR", 3, ints=(1,))
import torch
from megakernel.kernel.interpreter import KernelOptions
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine
from megakernel.runtime.trace import stage_summary, write_chrome_trace

model, batch, out = ARGS[0], int(ARGS[1]), ARGS[2]
cfg = get_preset(model)
eng = MegakernelEngine(random_weights(cfg, seed=3, device="cuda"), batch, 512, options=KernelOptions(trace=True))
eng.k_cache.normal_(0, 1); eng.v_cache.normal_(0, 1)      # a 32-token history
eng.bufs.tokens.fill_(1); eng.bufs.positions.fill_(32)
for _ in range(3):
    eng.launch()
torch.cuda.synchronize(); eng.check()
recs = eng.trace_records()
os.makedirs(out, exist_ok=True)
stem = os.path.join(out, f"trace_{model}_b{batch}")
write_chrome_trace(stem + ".json", recs, eng.program, f"{model} batch {batch}, one decode step at position 34")
summary = stage_summary(recs)
span = (max(r["end"] for r in recs) - min(r["begin"] for r in recs)) / 1e3
with open(stem + "_summary.json", "w") as f:
    json.dump({"model": model, "batch": batch, "span_us": span, "stages": summary}, f, indent=1)
print(f"{model} batch {batch}: span {span:.1f} us -> {stem}.json")
for s in summary:
    print(f"  {s['opcode']:13s} n={s['count']:5d} wait {s['wait_us']:7.2f} us work {s['work_us']:7.2f} us")

"""One megakernel decode step inside an NVTX range (domain "megakernel", range "decode_step"), after
warm-up steps outside it, for Nsight Compute to profile with --nvtx-include (tools/gpu_ncu.sh runs it).
Usage (GPU host): python3 tools/ncu_step.py MODEL BATCH [OPTIONS]
OPTIONS: engine options as tools/gpu_sweep.py takes them, e.g. 'diag_no_copy=1' (the timing-only build
without weight copies) or 'kv_splits=2'."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import positional  # noqa: E402
ARGS = positional(__doc__, "ncu_step.py MODEL BATCH [OPTIONS]", 2, ints=(1,))
from megakernel.runtime.engine import MegakernelEngine, parse_engine_options  # noqa: E402
try:
    OPTIONS = parse_engine_options(ARGS[2]) if len(ARGS) > 2 else {}
except ValueError as e:
    sys.exit(f"usage: ncu_step.py MODEL BATCH [OPTIONS]  ({e}; --help explains)")
import nvtx
import torch
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights

model, batch = ARGS[0], int(ARGS[1])
eng = MegakernelEngine(random_weights(get_preset(model), seed=3, device="cuda"), batch, 512, **OPTIONS)
eng.k_cache.normal_(0, 1); eng.v_cache.normal_(0, 1)
eng.bufs.tokens.fill_(1); eng.bufs.positions.fill_(32)
for _ in range(3):
    eng.launch()
torch.cuda.synchronize()
with nvtx.annotate("decode_step", domain="megakernel"):
    eng.launch()
    torch.cuda.synchronize()
eng.check()

"""One megakernel decode step inside an NVTX range (domain "megakernel", range "decode_step"), after
warm-up steps outside it, for Nsight Compute to profile with --nvtx-include."""
import sys
import nvtx
import torch
from megakernel.model.presets import get_preset
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine

model, batch = sys.argv[1], int(sys.argv[2])
eng = MegakernelEngine(random_weights(get_preset(model), seed=3, device="cuda"), batch, 512)
eng.k_cache.normal_(0, 1); eng.v_cache.normal_(0, 1)
eng.bufs.tokens.fill_(1); eng.bufs.positions.fill_(32)
for _ in range(3):
    eng.launch()
torch.cuda.synchronize()
with nvtx.annotate("decode_step", domain="megakernel"):
    eng.launch()
    torch.cuda.synchronize()
eng.check()

"""Find where kernel runs go wrong: one step from a fixed random cache history, run several times per
variant (buffers poisoned before each run). Per run: logits against the float32 reference decoder on
the same cache; every ATTN_PARTIAL instruction's partial recomputed by its torch reference from the
kernel's own qkv buffer and the pre-step cache; cache slots other than the new token's that the step
changed; and the first stage buffer that differs from the first run.
Usage: gpu_diag.py MODEL BATCH 'name:key=val,...' ... [--runs=N] [--pos=P]"""
import copy
import sys
import torch
from megakernel.instructions import attention
from megakernel.instructions.context import StageContext
from megakernel.instructions.opcodes import Opcode
from megakernel.kernel.interpreter import KernelOptions
from megakernel.model.kv_cache import PagedKVCache
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.weights import random_weights
from megakernel.runtime.engine import MegakernelEngine
sys.path.insert(0, "tools")
from gpu_sweep import parse, prepare  # noqa: E402
from toolargs import int_flag, positional  # noqa: E402

USAGE = "gpu_diag.py MODEL BATCH 'name:key=val,...' ... [--runs=N] [--pos=P]"
args = positional(__doc__, USAGE, 2, ints=(1,), flags=("--runs", "--pos"))
runs, pos = int_flag("--runs", 3, USAGE), int_flag("--pos", 32, USAGE)
model, B = args[0], int(args[1])
specs = args[2:] or ["default:"]
cfg = get_preset(model)
w = random_weights(cfg, seed=3, device="cuda")
L = cfg.num_layers


def snapshot(b):
    out = {}
    for l in range(L):
        out[f"L{l:02d}.qkv"] = b.qkv[l].clone()
        out[f"L{l:02d}.attn_part_o"] = b.attn_part_o[l].clone()
        out[f"L{l:02d}.h"] = b.h[l].clone()
        out[f"L{l:02d}.act"] = b.act[l].clone()
        out[f"L{l:02d}.x_out"] = b.x[l + 1].clone()
    out["logits"] = b.logits.clone()
    return out


def first_diff(a, bb):
    for k in a:
        x, y = a[k], bb[k]
        if not torch.equal(torch.isnan(x), torch.isnan(y)):
            return f"{k}: NaN pattern differs ({int(torch.isnan(x).sum())} vs {int(torch.isnan(y).sum())})"
        d = (torch.nan_to_num(x) - torch.nan_to_num(y)).abs()
        scale = torch.nan_to_num(x).abs().max().clamp_min(1e-6)
        if d.max() / scale > 1e-4:
            return f"{k}: max rel diff {float(d.max() / scale):.2e} at {int((d / scale > 1e-4).sum())} elements"
    return "identical"


def attn_check(eng, k_pre, v_pre):
    """Each ATTN_PARTIAL's torch reference on the kernel's own qkv and the pre-step cache."""
    bufs = copy.copy(eng.bufs)
    bufs.attn_part_o = torch.full_like(eng.bufs.attn_part_o, float("nan"))
    bufs.attn_part_lse = torch.full_like(eng.bufs.attn_part_lse, float("nan"))
    bufs.positions = eng.bufs.positions.clone().fill_(pos)
    ctx = StageContext(layout=eng.layout, weights=eng.weights, bufs=bufs, k_cache=k_pre.clone(),
                       v_cache=v_pre.clone())
    bad = []
    for ins in eng.program.instructions:
        if ins.opcode != Opcode.ATTN_PARTIAL:
            continue
        attention.reference(ins, ctx)
        g = cfg.gqa_group
        heads = slice(ins.a1 * g, (ins.a1 + 1) * g)
        ref = bufs.attn_part_o[ins.layer, ins.a0, heads, ins.a2]
        got = eng.bufs.attn_part_o[ins.layer, ins.a0, heads, ins.a2]
        err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))
        if not err < 1e-3:
            bad.append((ins.layer, ins.a0, ins.a1, ins.a2, err))
    return bad


base = None
ref_logits = None
for spec in specs:
    name, opts, eng_kw = parse(spec)
    eng = MegakernelEngine(w, B, 512, options=KernelOptions(**opts), **eng_kw)
    for r in range(runs):
        prepare(eng, pos, seed=0)
        k_pre, v_pre = eng.k_cache.clone(), eng.v_cache.clone()
        eng.bufs.poison()
        eng.launch(); torch.cuda.synchronize(); eng.check()
        res = snapshot(eng.bufs)
        if ref_logits is None:
            cache = PagedKVCache(k=k_pre.clone(), v=v_pre.clone(), block_size=eng.layout.block_size)
            ref_logits = ReferenceDecoder(w).step(torch.ones(B, dtype=torch.long, device="cuda"),
                                                  torch.full((B,), pos, dtype=torch.long, device="cuda"),
                                                  cache, eng.bufs.block_table.long())
        err = ((res["logits"] - ref_logits).norm() / ref_logits.norm()).item()
        # cache slots the step changed other than the new token's (pos)
        ch = (eng.k_cache != k_pre) | (eng.v_cache != v_pre)
        ch = ch & ~(torch.isnan(eng.k_cache) & torch.isnan(k_pre))
        bt = eng.bufs.block_table[:, pos // eng.layout.block_size].long()
        for b in range(B):
            ch[:, bt[b], pos % eng.layout.block_size] = False
        stray = torch.nonzero(ch)
        bad = attn_check(eng, k_pre, v_pre)
        print(f"{name} run {r}: logits rel err {err:.2e} argmax agree "
              f"{torch.equal(res['logits'].argmax(1), ref_logits.argmax(1))}; stray cache writes {stray.shape[0]}"
              f"{' first ' + str(stray[:4].tolist()) if stray.shape[0] else ''}; attention partials off "
              f"{len(bad)}{' e.g. (layer,b,kvh,split,err) ' + str(bad[:6]) if bad else ''}; vs first run: "
              f"{first_diff(base, res) if base is not None else '-'}", flush=True)
        if base is None:
            base = res
    del eng

"""Small device helpers over raw global and shared addresses, written as inline PTX where CuTe DSL has
no wrapper: activation and embedding loads, bulk copies and mbarriers, the m16n8k16 MMA and the wgmma on
registers loaded in the packed weight order (with the wgmma's shared-memory descriptor), the attention's
m16n8k16 / m16n8k8 MMAs on fragments from raw 16-byte loads, the bf16 pack and unpack (and prmt pairing), and
the counter primitives of the step's dependency protocol, and the flagged hops' 8-byte {value, epoch} words."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, as_numeric, dsl_user_op


@cute.jit
def load_bf16x8(addr: Int64):
    """8 bf16 at a 16-byte aligned address (read-only path, e.g. an embedding row) -> 8 float32."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t0, t1, t2, t3;\n"
        "ld.global.nc.v4.b32 {t0, t1, t2, t3}, [{$r0}];\n"
        "shl.b32 {$w0}, t0, 16; and.b32 {$w1}, t0, 0xffff0000;\n"
        "shl.b32 {$w2}, t1, 16; and.b32 {$w3}, t1, 0xffff0000;\n"
        "shl.b32 {$w4}, t2, 16; and.b32 {$w5}, t2, 0xffff0000;\n"
        "shl.b32 {$w6}, t3, 16; and.b32 {$w7}, t3, 0xffff0000; }",
        write_only_types=[Float32] * 8, read_only_args=[addr])


@cute.jit
def load_global_b32x4(addr: Int64):
    """Four raw 32-bit words of global memory at a 16-byte aligned address in one load (e.g. 8 packed bf16 of a
    cached key, unpacked with unpack_bf16x2 where they are used)."""
    return cute.arch.inline_ptx("ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[addr])


@cute.jit
def unpack_bf16x2(w: Int32):
    """One word of packed bf16 (low half first) -> 2 float32, as unpack_bf16x8 does for four."""
    return cute.arch.inline_ptx("shl.b32 {$w0}, {$r0}, 16; and.b32 {$w1}, {$r0}, 0xffff0000;",
                                write_only_types=[Float32] * 2, read_only_args=[w])


@cute.jit
def mma_bf16_16816(a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
                   c0: Float32, c1: Float32, c2: Float32, c3: Float32):
    """One warp-wide m16n8k16 tensor-core MMA, D = A B + C: bf16 A (16 x 16, four packed-pair registers in
    the order fragment_pack lays weights out), bf16 B (16 x 8, two registers), float32 C and D (16 x 8,
    four registers: rows lane // 4 and + 8, columns 2 (lane % 4) and + 1). Written as PTX because its
    operands come straight from 16-byte shared-memory loads in that order, not from CuTe fragments."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])


@cute.jit
def mma_bf16_16816_rows8(a0: Int32, a2: Int32, b0: Int32, b1: Int32, c0: Float32, c1: Float32, c2: Float32,
                         c3: Float32):
    """mma_bf16_16816 with A's rows 8-15 zero (a1 = a3 = 0: an M of at most 8 rows). The zeros are a register
    declared inside the asm: constant zeros passed in as operands fail the backend compile ("NVVM backend
    compilation failed", no log); likewise C = 0 in mma_bf16_16816_rows8_zero."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 z; mov.b32 z, 0;\n"
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, z, {$r1}, z}, {{$r2}, {$r3}}, {{$r4}, {$r5}, {$r6}, {$r7}}; }",
        write_only_types=[Float32] * 4, read_only_args=[a0, a2, b0, b1, c0, c1, c2, c3])


@cute.jit
def mma_bf16_16816_rows8_zero(a0: Int32, a2: Int32, b0: Int32, b1: Int32):
    """mma_bf16_16816_rows8 with C = 0: D = A B."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 z; .reg .f32 zf; mov.b32 z, 0; mov.f32 zf, 0f00000000;\n"
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, z, {$r1}, z}, {{$r2}, {$r3}}, {zf, zf, zf, zf}; }",
        write_only_types=[Float32] * 4, read_only_args=[a0, a2, b0, b1])


@cute.jit
def mma_bf16_1688(a0: Int32, a1: Int32, b0: Int32, c0: Float32, c1: Float32, c2: Float32, c3: Float32):
    """One warp-wide m16n8k8 tensor-core MMA, D = A B + C: bf16 A (16 x 8: a0 row lane // 4, a1 row + 8,
    columns 2 (lane % 4) and + 1), bf16 B (8 x 8, one register: rows 2 (lane % 4) and + 1, column lane // 4),
    float32 C and D as mma_bf16_16816's."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}}, {{$r2}}, {{$r3}, {$r4}, {$r5}, {$r6}};",
        write_only_types=[Float32] * 4, read_only_args=[a0, a1, b0, c0, c1, c2, c3])


@cute.jit
def low_halves(x: Int32, y: Int32) -> Int32:
    """The low 16 bits of x (low half) and of y (high half): two bf16 of one element index from two packed
    words (prmt)."""
    return cute.arch.inline_ptx("prmt.b32 {$w0}, {$r0}, {$r1}, 0x5410;", write_only_types=[Int32],
                                read_only_args=[x, y])


@cute.jit
def high_halves(x: Int32, y: Int32) -> Int32:
    """The high 16 bits of x (low half) and of y (high half) (prmt)."""
    return cute.arch.inline_ptx("prmt.b32 {$w0}, {$r0}, {$r1}, 0x7632;", write_only_types=[Int32],
                                read_only_args=[x, y])


def wgmma_desc(addr: Int32, lbo: int, sbo: int) -> Int64:
    """The shared-memory matrix descriptor of a wgmma operand without swizzle (layout type 0) at 16-byte aligned
    `addr`: the start address, the byte offset between core matrices along K (`lbo`) and along M or N (`sbo`),
    each in 16-byte units."""
    return Int64((addr >> 4) & 0x3FFF) | Int64((((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32))


@dsl_user_op
def _wgmma_bf16_rs(n: int, d: list, a: list, b_desc: Int64, *, loc=None, ip=None) -> list:
    """wgmma m64nNk16 with bf16 A in registers and B through a descriptor, on float32 accumulators d (n / 2 of
    them) tied to its outputs: the accumulators stay in their registers while the wgmma runs (llvm inline asm,
    as nvvm's inline_ptx does not tie read-write operands to results)."""
    nd = n // 2
    regs = ", ".join(f"${i}" for i in range(nd))
    ins = [as_numeric(x).ir_value(loc=loc, ip=ip) for x in d]
    ins += [as_numeric(x).ir_value(loc=loc, ip=ip) for x in a]
    ins += [as_numeric(b_desc).ir_value(loc=loc, ip=ip), as_numeric(Int32(1)).ir_value(loc=loc, ip=ip)]
    ra, rd, rs = 2 * nd, 2 * nd + 4, 2 * nd + 5
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * nd), ins,
        "{\n.reg .pred p;\n" + f"setp.ne.b32 p, ${rs}, 0;\n"
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, "
        f"{{${ra}, ${ra + 1}, ${ra + 2}, ${ra + 3}}}, ${rd}, p, 1, 1, 0;\n}}",
        ",".join(["=f"] * nd + [str(i) for i in range(nd)] + ["r"] * 4 + ["l", "r"]),
        has_side_effects=True, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(nd)]


@cute.jit
def wgmma_bf16_rs(n: int, acc: cute.Tensor, base: int, a0: Int32, a1: Int32, a2: Int32, a3: Int32, b_desc: Int64):
    """One warpgroup-wide wgmma m64nNk16 (N = `n`), acc[base .. base + n / 2] += A B: bf16 A (64 x 16, each warp's
    16 rows as the four packed-pair registers of an m16n8k16 A fragment, the order fragment_pack lays weights
    out), bf16 B (16 x N) from shared memory through `b_desc` (K-major), float32 accumulators in the layout of
    n / 8 m16n8 C fragments (rows lane // 4 and + 8 of the warp's 16, columns 8 i + 2 (lane % 4) and + 1).
    Asynchronous: the warpgroup fences before (cute.nvgpu.warpgroup.fence), commits after and waits before it
    reads acc or changes the A registers or B. Written as PTX because A comes straight from 16-byte
    shared-memory loads in that order, not from CuTe fragments."""
    c = []
    for i in cutlass.range_constexpr(n // 2):
        c.append(acc[base + i])
    d = _wgmma_bf16_rs(n, c, [a0, a1, a2, a3], b_desc)
    for i in cutlass.range_constexpr(n // 2):
        acc[base + i] = d[i]


@cute.jit
def st_shared_b32x4(addr: Int32, v0: Int32, v1: Int32, v2: Int32, v3: Int32):
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, v0, v1, v2, v3])


@cute.jit
def st_shared_b32x2(addr: Int32, v0: Int32, v1: Int32):
    cute.arch.inline_ptx("st.shared.v2.b32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, v0, v1])


@cute.jit
def pack_bf16x2(x0: Float32, x1: Float32) -> Int32:
    """Two float32 rounded to bf16 and packed, x0 in the low half (what unpack_bf16x2 unpacks)."""
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};", write_only_types=[Int32],
                                read_only_args=[x0, x1])


@cute.jit
def ld_shared_f32x4(addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Float32] * 4, read_only_args=[addr])


@cute.jit
def load_f32x4(addr: Int64):
    """4 float32 activations written earlier in this step by other CTAs (coherent path)."""
    return cute.arch.inline_ptx(
        "ld.global.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32] * 4, read_only_args=[addr])


@cute.jit
def mbarrier_init(mbar: Int32, count: Int32):
    """Initialise a shared-memory mbarrier (8 bytes at shared address `mbar`) for `count` arrivals."""
    cute.arch.inline_ptx("mbarrier.init.shared::cta.b64 [{$r0}], {$r1};", read_only_args=[mbar, count])


@cute.jit
def mbarrier_init_fence():
    """Make initialised mbarriers visible to the async proxy (the bulk copy engine)."""
    cute.arch.inline_ptx("fence.mbarrier_init.release.cluster;")


@cute.jit
def bulk_copy_g2s(dst: Int32, src: Int64, nbytes: Int32, mbar: Int32, policy: Int64):
    """One bulk copy of `nbytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to
    shared `dst` by the copy engine, read under the L2 cache policy `policy` (createpolicy); completion is
    counted in bytes on the mbarrier at `mbar`, which the issuing thread armed with mbarrier_arrive_expect_tx
    for the same byte count."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [{$r0}], [{$r1}], {$r2}, "
        "[{$r3}], {$r4};", read_only_args=[dst, src, nbytes, mbar, policy])


@cute.jit
def policy_evict_first() -> Int64:
    """An L2 cache policy under which the lines read are the first evicted (data read once: the weights)."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_first.b64 {$w0}, 1.0;", write_only_types=[Int64])


@cute.jit
def policy_evict_last() -> Int64:
    """An L2 cache policy under which the lines read are the last evicted (data many SMs read: the pre-staged
    matvec inputs)."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_last.b64 {$w0}, 1.0;", write_only_types=[Int64])


@cute.jit
def mbarrier_arrive_expect_tx(mbar: Int32, nbytes: Int32):
    """Arrive on the mbarrier and expect `nbytes` of transactions before its phase completes."""
    cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};", read_only_args=[mbar, nbytes])


@cute.jit
def mbarrier_try_wait(mbar: Int32, parity: Int32) -> Int32:
    """1 once the mbarrier's phase of the given parity has completed (a bounded hardware wait), else 0."""
    return cute.arch.inline_ptx(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{$r0}], {$r1}; selp.b32 {$w0}, 1, 0, p; }",
        write_only_types=[Int32], read_only_args=[mbar, parity])


@cute.jit
def cp_async_shared(dst: Int32, src: Int64, nbytes: int):
    """Asynchronous copy of nbytes (4, 8 or 16; both addresses aligned to it) from global `src` to shared
    `dst` (LDGSTS): no register holds the data; cp_async_wait_all makes it visible to this thread."""
    cute.arch.inline_ptx(f"cp.async.ca.shared.global [{{$r0}}], [{{$r1}}], {nbytes};", read_only_args=[dst, src])


@cute.jit
def cp_async_wait_all():
    """Wait for this thread's cp.async copies (and commit the pending ones first)."""
    cute.arch.inline_ptx("cp.async.wait_all;")


@cute.jit
def load_shared_b32(addr: Int32) -> Int32:
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def st_shared_b32(addr: Int32, v: Int32):
    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def load_shared_raw(addr: Int32):
    """16 bytes of shared memory at a 16-byte aligned address as 4 raw 32-bit words (weights a bulk
    copy put there; unpack_bf16x8 converts them as it does the global loads')."""
    return cute.arch.inline_ptx("ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[addr])


@cute.jit
def load_acquire(addr: Int64) -> Int32:
    return cute.arch.inline_ptx("ld.acquire.gpu.global.b32 {$w0}, [{$r0}];",
                                write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def load_acquire_sys(addr: Int64) -> Int32:
    """ld.acquire at system scope: a counter that another GPU's CTAs signal (tensor parallel)."""
    return cute.arch.inline_ptx("ld.acquire.sys.global.b32 {$w0}, [{$r0}];",
                                write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def red_release_add(addr: Int64, value: Int32):
    cute.arch.inline_ptx("red.release.gpu.global.add.s32 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def red_release_add_sys(addr: Int64, value: Int32):
    """red.release at system scope: a counter that another GPU's CTAs wait on (tensor parallel's exchanges)."""
    cute.arch.inline_ptx("red.release.sys.global.add.s32 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def atomic_add_acq_rel(addr: Int64, value: Int32) -> Int32:
    return cute.arch.inline_ptx("atom.acq_rel.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
                                write_only_types=[Int32], read_only_args=[addr, value])


@cute.jit
def atomic_cas(addr: Int64, compare: Int32, value: Int32) -> Int32:
    return cute.arch.inline_ptx("atom.relaxed.gpu.global.cas.b32 {$w0}, [{$r0}], {$r1}, {$r2};",
                                write_only_types=[Int32], read_only_args=[addr, compare, value])


@cute.jit
def store_relaxed(addr: Int64, value: Int32):
    cute.arch.inline_ptx("st.relaxed.gpu.global.b32 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def report_error(error: Int64, code: Int32, index: Int32, detail: Int32, value: Int32):
    """The step's error word {code, instruction index, detail, value}, written by the first error only: after
    another's, the compare-and-swap of the code from 0 fails and nothing is stored."""
    if atomic_cas(error, Int32(0), code) == 0:
        store_relaxed(error + 4, index)
        store_relaxed(error + 8, detail)
        store_relaxed(error + 12, value)


@cute.jit
def load_relaxed(addr: Int64) -> Int32:
    """A gpu-scope relaxed load: sees another CTA's store without the ordering of an acquire (the error word)."""
    return cute.arch.inline_ptx("ld.relaxed.gpu.global.b32 {$w0}, [{$r0}];",
                                write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def store_system_nonzero(addr: Int64, value: Int32):
    """A system-scope store of `value` where it is not 0 (predicated, no branch): to mapped host memory,
    which the host reads without a device sync."""
    cute.arch.inline_ptx("{ .reg .pred p; setp.ne.s32 p, {$r1}, 0; @p st.relaxed.sys.global.b32 [{$r0}], {$r1}; }",
                         read_only_args=[addr, value])


@cute.jit
def warp_sum(v: Float32) -> Float32:
    for off in [16, 8, 4, 2, 1]:
        v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
    return v


@cute.jit
def max_index(v: Float32, i: Int32, ov: Float32, oi: Int32):
    """(v, i) and (ov, oi) merged: the larger value, the lower index among equal ones (the one rule every (max,
    index) merge of the LM head and ARGMAX follows, so the token is a serial scan's whatever the merge order)."""
    if ov > v or (ov == v and oi < i):
        v = ov
        i = oi
    return v, i


@cute.jit
def warp_max_index(v: Float32, i: Int32, offsets: tuple = (16, 8, 4, 2, 1)):
    """(max, lowest index among equal maxima) of a warp's (value, index) pairs, on every lane (over the lanes
    that differ in the bits of `offsets` only, where given)."""
    for off in offsets:
        v, i = max_index(v, i, cute.arch.shuffle_sync_bfly(v, offset=off), cute.arch.shuffle_sync_bfly(i, offset=off))
    return v, i


@cute.jit
def ld_i32(addr: Int64) -> Int32:
    return cute.arch.inline_ptx("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def ld_i64(addr: Int64) -> Int64:
    return cute.arch.inline_ptx("ld.global.b64 {$w0}, [{$r0}];", write_only_types=[Int64], read_only_args=[addr])


@cute.jit
def ld_f32(addr: Int64) -> Float32:
    return cute.arch.inline_ptx("ld.global.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[addr])


@cute.jit
def ld_bf16(addr: Int64) -> Float32:
    return cute.arch.inline_ptx("{ .reg .b16 t; ld.global.nc.b16 t, [{$r0}]; cvt.f32.bf16 {$w0}, t; }",
                                write_only_types=[Float32], read_only_args=[addr])


@cute.jit
def st_f32(addr: Int64, v: Float32):
    cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def st_f32x2(addr: Int64, v0: Float32, v1: Float32):
    """Two float32 to consecutive words (8-byte aligned)."""
    cute.arch.inline_ptx("st.global.v2.f32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, v0, v1])


@cute.jit
def st_f32x4(addr: Int64, v0: Float32, v1: Float32, v2: Float32, v3: Float32):
    """Four float32 to consecutive words (16-byte aligned)."""
    cute.arch.inline_ptx("st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, v0, v1, v2, v3])


@cute.jit
def st_b32x4(addr: Int64, v0: Int32, v1: Int32, v2: Int32, v3: Int32):
    """Four raw 32-bit words to global memory (16-byte aligned), e.g. 8 packed bf16."""
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, v0, v1, v2, v3])


@cute.jit
def st_b32x2(addr: Int64, v0: Int32, v1: Int32):
    """Two raw 32-bit words to global memory (8-byte aligned), e.g. 4 packed bf16."""
    cute.arch.inline_ptx("st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, v0, v1])


@cute.jit
def st_i32(addr: Int64, v: Int32):
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def st_bf16(addr: Int64, v: Float32):
    cute.arch.inline_ptx("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r1}; st.global.b16 [{$r0}], t; }",
                         read_only_args=[addr, v])


@cute.jit
def round_bf16(v: Float32) -> Float32:
    return cute.arch.inline_ptx("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r0}; cvt.f32.bf16 {$w0}, t; }",
                                write_only_types=[Float32], read_only_args=[v])


@cute.jit
def ex2(v: Float32) -> Float32:
    return cute.arch.inline_ptx("ex2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def lg2(v: Float32) -> Float32:
    return cute.arch.inline_ptx("lg2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def rsqrt(v: Float32) -> Float32:
    return cute.arch.inline_ptx("rsqrt.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[v])


@cute.jit
def load_weights_bf16x4(addr: Int64):
    """4 bf16 at an 8-byte aligned address (read-only path) -> 4 float32."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t0, t1;\n"
        "ld.global.nc.v2.b32 {t0, t1}, [{$r0}];\n"
        "shl.b32 {$w0}, t0, 16; and.b32 {$w1}, t0, 0xffff0000;\n"
        "shl.b32 {$w2}, t1, 16; and.b32 {$w3}, t1, 0xffff0000; }",
        write_only_types=[Float32] * 4, read_only_args=[addr])


@cute.jit
def load_nc_b32x2(addr: Int64):
    """Two raw 32-bit words at an 8-byte aligned address by the read-only path (4 packed bf16 of a weight
    row, unpacked with unpack_bf16x2 where they are used, so that loads can go out together first)."""
    return cute.arch.inline_ptx("ld.global.nc.v2.b32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Int32] * 2,
                                read_only_args=[addr])


@cute.jit
def globaltimer_lo() -> Int32:
    return Int32(cute.arch.globaltimer() & Int64(0x7FFFFFFF))


@cute.jit
def load_shared_volatile(addr: Int32) -> Int32:
    """A shared-memory word another warp may have written since this thread last read it (never cached
    in a register across a spin loop)."""
    return cute.arch.inline_ptx("ld.volatile.shared.b32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[addr])


@cute.jit
def mbarrier_arrive(mbar: Int32):
    """One arrival on the shared-memory mbarrier at `mbar`."""
    cute.arch.inline_ptx("mbarrier.arrive.shared::cta.b64 _, [{$r0}];", read_only_args=[mbar])


@cute.jit
def as_f32(w: Int32) -> Float32:
    """A raw 32-bit word as the float32 it holds."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[w])


@cute.jit
def st_flagged(addr: Int64, v: Float32, flag: Int32):
    """One 8-byte word {v, flag} (8-byte aligned), a single-copy atomic store at gpu scope: a reader that sees the
    flag sees the value beside it (the flagged hops, megakernel.instructions.flagged)."""
    cute.arch.inline_ptx("{ .reg .b64 t; mov.b64 t, {{$r1}, {$r2}}; st.relaxed.gpu.global.b64 [{$r0}], t; }",
                         read_only_args=[addr, v, flag])


@cute.jit
def ld_flagged_x2(addr: Int64):
    """Two 8-byte words {value, flag} (16-byte aligned) at gpu scope, each single-copy atomic:
    (value0, flag0, value1, flag1) as raw 32-bit words."""
    return cute.arch.inline_ptx(
        "{ .reg .b64 a, b; ld.relaxed.gpu.global.v2.b64 {a, b}, [{$r0}]; mov.b64 {{$w0}, {$w1}}, a; "
        "mov.b64 {{$w2}, {$w3}}, b; }",
        write_only_types=[Int32] * 4, read_only_args=[addr])


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("cutlass", "cute", "annotations")]

"""Device code of tensor parallel's exchanges (megakernel.instructions.tensor_parallel has the records, the data flow
and the torch references; megakernel.schedule.tensor_parallel the program every rank runs).

A rank reaches every rank's receive buffers, argmax slots and counters through its peer table (int64 [world_size,
stream.PEER_WORDS], rank order, its own row included): on one GPU the buffers of the other ranks' engines, across
GPUs peer-mapped memory. The exchange stages (TP_O_PROJ, TP_DOWN, TP_LM_HEAD) are their dense stages over the
rank's shard (stream.dense_opcode) whose epilogue stores go to every rank's slot (matvec.epilogue,
matvec.store_tile_maximum) and whose signal is a system-scope release on every rank's counter (the interpreter);
TP_REDUCE, here, adds the received partials up once its exchange counter has every rank's tiles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .ptx import ld_f32, st_f32
from .stream import PEER_RECV_DOWN, PEER_RECV_O


class ExchangeStages:
    """Tensor parallel's reduce (a mixin of the interpreter)."""

    @cute.jit
    def tp_reduce(self, tidx: Int32, layer: Int32, a0: Int32, a1: Int32, a3: Int32, p):
        """Rows a0 .. a0 + a1 of every sequence: ATTENTION (a3 = 0) h[l] = x[l] + recv_o[l][0] + ... + recv_o[l][W-1],
        FFN (a3 = 1) x[l+1] = h[l] + recv_down[l][0] + ...: the partials in rank order, then the residual, as the
        reference adds them (every rank the same bits)."""
        B, H, W = self.B, self.H, self.W
        l64 = Int64(layer)
        recv = self.peer_address(p, self.rank, Int32(PEER_RECV_O))
        res = p.x + l64 * (B * H * 4)
        out = p.h + l64 * (B * H * 4)
        if a3 != 0:
            recv = self.peer_address(p, self.rank, Int32(PEER_RECV_DOWN))
            res = p.h + l64 * (B * H * 4)
            out = p.x + (l64 + 1) * (B * H * 4)
        for t in range(tidx, a1 * B, self.cthreads):
            b = t // a1
            i = Int64(b) * H + Int64(a0 + t - b * a1)
            vals = cute.make_rmem_tensor((W,), Float32)
            for s in cutlass.range_constexpr(W):          # every load first
                vals[s] = ld_f32(recv + ((l64 * W + s) * (B * H) + i) * 4)
            total = vals[0]
            for s in cutlass.range_constexpr(1, W):
                total = total + vals[s]
            st_f32(out + i * 4, ld_f32(res + i * 4) + total)

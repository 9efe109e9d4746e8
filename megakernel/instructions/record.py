"""The fixed-size instruction record: 16 int32 words, the unit of the per-SM queues."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .opcodes import Opcode

WORDS = 16
NO_COUNTER = -1

# Word positions, shared by the serializer, the VM and the device decoder.
(W_OPCODE, W_LAYER, W_A0, W_A1, W_A2, W_A3, W_WAIT_ID, W_WAIT_COUNT, W_SIGNAL_ID, W_INDEX, W_K_PART, W_K_PARTS,
 W_SEQS) = range(13)


@dataclass(frozen=True)
class Instruction:
    """One fused-stage instruction.

    ``a0..a3`` are the stage's operands (see each stage module); ``wait_id``/``wait_count`` name the
    counter and the per-step count this instruction waits for; ``signal_id`` the counter it adds 1 to
    when its stores are done; ``index`` is its position in the global topological order (for traces
    and error reports). ``k_part`` of ``k_parts`` is the K range of a matvec tile split over K (split_k.py);
    an unsplit tile is range 0 of 1. ``seqs`` is the number of sequences from ``a0`` an ATTN_PARTIAL takes (its
    consumer warps shared out among them; attention.sequence_groups); 1 for every other instruction.
    """

    opcode: Opcode
    layer: int = 0
    a0: int = 0
    a1: int = 0
    a2: int = 0
    a3: int = 0
    wait_id: int = NO_COUNTER
    wait_count: int = 0
    signal_id: int = NO_COUNTER
    index: int = -1
    k_part: int = 0
    k_parts: int = 1
    seqs: int = 1
    cost: float = field(default=0.0, compare=False)

    def encode(self) -> list[int]:
        words = [0] * WORDS
        words[W_OPCODE] = int(self.opcode)
        words[W_LAYER] = self.layer
        words[W_A0], words[W_A1], words[W_A2], words[W_A3] = self.a0, self.a1, self.a2, self.a3
        words[W_WAIT_ID] = self.wait_id
        words[W_WAIT_COUNT] = self.wait_count
        words[W_SIGNAL_ID] = self.signal_id
        words[W_INDEX] = self.index
        words[W_K_PART], words[W_K_PARTS] = self.k_part, self.k_parts
        words[W_SEQS] = self.seqs
        return words

    @classmethod
    def decode(cls, words) -> "Instruction":
        w = [int(x) for x in words]
        return cls(opcode=Opcode(w[W_OPCODE]), layer=w[W_LAYER], a0=w[W_A0], a1=w[W_A1], a2=w[W_A2],
                   a3=w[W_A3], wait_id=w[W_WAIT_ID], wait_count=w[W_WAIT_COUNT],
                   signal_id=w[W_SIGNAL_ID], index=w[W_INDEX], k_part=w[W_K_PART], k_parts=w[W_K_PARTS],
                   seqs=w[W_SEQS])


def serialize(queues: list[list[Instruction]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Queues -> (int32 [num_sms, max_len, WORDS], int32 [num_sms] lengths)."""
    max_len = max(1, max(len(q) for q in queues))
    out = torch.zeros(len(queues), max_len, WORDS, dtype=torch.int32)
    lengths = torch.zeros(len(queues), dtype=torch.int32)
    for sm, queue in enumerate(queues):
        lengths[sm] = len(queue)
        for i, ins in enumerate(queue):
            out[sm, i] = torch.tensor(ins.encode(), dtype=torch.int32)
    return out, lengths


def deserialize(table: torch.Tensor, lengths: torch.Tensor) -> list[list[Instruction]]:
    return [[Instruction.decode(table[sm, i].tolist()) for i in range(int(lengths[sm]))]
            for sm in range(table.shape[0])]

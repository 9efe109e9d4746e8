"""Per-SM speeds (megakernel.runtime.sm_speeds): their measurement from a trace's LM head, and the tile caps of a
speed-sized schedule. CPU only (the records are written here; the schedule's own checks are in test_schedule.py)."""

from __future__ import annotations

import random
import statistics

import pytest

from megakernel.instructions.layout import SPLIT_BATCH, StepLayout
from megakernel.instructions.matvec_stages import MATVEC_OPCODES, weight_rows
from megakernel.instructions.opcodes import Opcode
from megakernel.instructions.split_k import split_tile_rows
from megakernel.kernel.interpreter import KernelOptions
from megakernel.kernel.stream import StreamPlan
from megakernel.model.presets import get_preset
from megakernel.runtime.sm_speeds import measure_sm_speeds, speed_row_caps
from megakernel.schedule import assign, build_program


def _layout(name: str, batch: int, num_sms: int) -> StepLayout:
    return StepLayout(config=get_preset(name), batch=batch, kv_splits=1, block_size=16, max_blocks_per_seq=8,
                      num_sms=num_sms)


@pytest.mark.parametrize("name,num_sms", [("tiny-llama", 5), ("llama-3.2-1b", 132)])
def test_measured_speeds_are_each_ctas_lm_head_bytes_per_ns_relative_to_the_mean(name, num_sms):
    rng = random.Random(num_sms)
    program = build_program(_layout(name, 1, num_sms))
    k = program.layout.config.hidden_size
    rate = [rng.uniform(20.0, 40.0) for _ in range(num_sms)]          # bytes per ns, by CTA
    records = []
    for sm, queue in enumerate(assign(program, "balanced")):
        for ins in queue:
            ready = rng.randrange(10_000)
            rec = {"sm": sm, "index": ins.index, "opcode": ins.opcode.name, "begin": ready - 50, "ready": ready,
                   "end": ready + 90_000}
            if ins.opcode == Opcode.LM_HEAD:
                rec["landed_last"] = ready + round(ins.a1 * k * 2 / rate[sm])
            records.append(rec)
    owners = {r["sm"] for r in records if r["opcode"] == "LM_HEAD"}
    speeds = measure_sm_speeds(records, program)
    assert len(speeds) == num_sms and abs(sum(speeds) / num_sms - 1) < 1e-12
    # a CTA without an LM head tile: the median of the others
    ref = [rate[sm] if sm in owners else statistics.median(rate[o] for o in owners) for sm in range(num_sms)]
    mean = sum(ref) / num_sms
    for sm in range(num_sms):
        assert speeds[sm] == pytest.approx(ref[sm] / mean, rel=1e-4), sm


def test_a_trace_without_the_lm_head_measures_nothing():
    program = build_program(_layout("tiny-llama", 1, 5), lm_head=False)
    records = [{"sm": 0, "index": 0, "opcode": "QKV", "begin": 0, "ready": 5, "end": 9, "landed_last": 8}]
    with pytest.raises(ValueError, match="no LM head tile"):
        measure_sm_speeds(records, program)


@pytest.mark.parametrize("batch", (1, 4, 8))
@pytest.mark.parametrize("name", ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b", "llama-2-7b"))
def test_row_caps_keep_a_tile_within_the_chunks_of_the_equal_tile(name, batch):
    """A speed-sized tile may grow up to the end of the equal tile's last chunk of rows, never into a chunk more."""
    layout = _layout(name, batch, 132)
    plan = StreamPlan.for_config(layout.config, batch)
    caps = speed_row_caps(layout)
    assert set(caps) == set(MATVEC_OPCODES)
    for op, cap in caps.items():
        equal = split_tile_rows(layout, op, 1)
        chunk = plan.geometry(weight_rows(op, layout)[1]).chunk_rows
        assert equal <= cap < equal + chunk and cap % chunk == 0, (op.name, equal, chunk, cap)
        assert -(-cap // chunk) == -(-equal // chunk), (op.name, equal, chunk, cap)


def test_row_caps_past_split_batch_leave_the_equal_tiles_cap():
    assert speed_row_caps(_layout("llama-3.2-1b", 2 * SPLIT_BATCH, 132)) == {}


def test_measured_speeds_come_from_a_traced_batch_1_twin_once_per_device_and_sm_count(monkeypatch):
    import torch

    from megakernel.runtime import sm_speeds as mod
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(mod, "_MEASURED", {})
    rates = [20.0, 26.0, 23.0, 21.0, 25.0]
    built = []

    class Twin:
        """What measured_sm_speeds touches of a trace-mode engine: its LM head tiles stream at `rates`."""

        def __init__(self, weights, batch, max_seq_len, *, num_sms, options, device, packed_weights, **layout_kw):
            built.append((batch, max_seq_len, num_sms, options.trace, layout_kw))
            self.device = device
            self.program = build_program(_layout("tiny-llama", 1, num_sms))
            self.layout = self.program.layout
            self.queues = assign(self.program, "balanced")
            self.bufs = type("Bufs", (), {"tokens": torch.ones(1), "positions": torch.ones(1)})()
            self.launches = 0

        def reset_sync(self):
            pass

        def launch(self):
            assert int(self.bufs.positions[0]) == 0
            self.launches += 1

        def check(self):
            pass

        def trace_records(self):
            k = self.program.layout.config.hidden_size
            return [{"sm": sm, "smid": 40 + sm, "index": i.index, "opcode": i.opcode.name, "begin": 0, "ready": 10,
                     "landed_last": 10 + round(i.a1 * k * 2 / rates[sm])}
                    for sm, q in enumerate(self.queues) for i in q if i.opcode == Opcode.LM_HEAD]

    speeds = mod.measured_sm_speeds(Twin, None, None, 64, "cuda:0", 5, fold_embed=True)
    again = mod.measured_sm_speeds(Twin, None, None, 64, "cuda:0", 5, fold_embed=True)
    assert again == speeds and len(built) == 1
    assert built[0] == (1, 64, 5, True, {"fold_embed": True})
    owners = {sm for sm, q in enumerate(assign(build_program(_layout("tiny-llama", 1, 5)), "balanced"))
              for i in q if i.opcode == Opcode.LM_HEAD}
    for a in owners:
        for b in owners:
            if rates[a] > rates[b] * 1.05:
                assert speeds[a] > speeds[b], (a, b, speeds)
    mod.measured_sm_speeds(Twin, None, None, 64, "cuda:0", 4, fold_embed=True)
    assert len(built) == 2                  # another SM count: measured again
    # each run: the speeds and, per CTA of the trace, its physical SM
    runs = mod.speed_runs(Twin(None, 1, 64, num_sms=5, options=KernelOptions(trace=True), device="cuda:0",
                               packed_weights=None), 3)
    assert len(runs) == 3 and all(sp == speeds and sms == {sm: 40 + sm for sm in owners} for sp, sms in runs)

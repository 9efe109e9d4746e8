"""The vLLM integration with tensor_parallel_size > 1, on the CPU: which models a rank can serve (tp_reason), the
rank's shard read from vLLM's per-rank parameters with the whole embedding gathered (weights_from_vllm against
model.tensor_parallel.shard_weights), and the adapter's decisions, which every rank must take alike (a rank that
runs stock while another launches the kernel leaves the other waiting on exchange counters): agreed at weight
load, collective at engine build, raised (never a silent stock step on one rank) on the decode path. vLLM's
tensor-parallel group is threads (megakernel.testing.ranks); its modules and metadata are stand-ins with
vLLM's names and per-rank layouts (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from megakernel.instructions.layout import StepLayout, validate_packed_weights
from megakernel.instructions.tensor_parallel.layout import ShardLayout
from megakernel.integrations import vllm_mapping as vmap
from megakernel.integrations import vllm_model as vm
from megakernel.model.presets import get_preset
from megakernel.model.tensor_parallel import shard_config, shard_weights
from megakernel.model.weights import random_weights
from megakernel.runtime.collective import collective
from megakernel.testing.ranks import run_rank_threads

W = 2
# q_size / 2 and intermediate_size / 2 in whole column passes of 256; a tied vocabulary of 1024 (no padding),
# and an untied one of 1008 (vLLM pads it to 1024: rank 1's shard holds ids 512..1007, not 504..1007)
TP_LLAMA = dataclasses.replace(get_preset("tiny-llama"), num_heads=8, intermediate_size=1024, name="tiny-llama-tp")
TP_QWEN3 = dataclasses.replace(get_preset("tiny-qwen3"), intermediate_size=512, vocab_size=1008, name="tiny-qwen3-tp")
TP_QWEN3_1024 = dataclasses.replace(TP_QWEN3, vocab_size=1024, name="tiny-qwen3-tp-1024")
VOCAB_PAD = 64           # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _module(**tensors):
    m = torch.nn.Module()
    for name, t in tensors.items():
        if isinstance(t, torch.nn.Module):
            setattr(m, name, t)
        elif isinstance(t, torch.Tensor):
            m.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
        else:
            setattr(m, name, t)
    return m


def _vocab_shard(table: torch.Tensor, rank: int):
    """A VocabParallelEmbedding / ParallelLMHead of rank `rank`: the vocabulary padded to a multiple of 64 with NaN
    rows, split evenly, with its shard_indices."""
    v, h = table.shape
    padded = -(-v // VOCAB_PAD) * VOCAB_PAD
    per = padded // W
    full = torch.cat([table, torch.full((padded - v, h), float("nan"), dtype=table.dtype)])
    ids = SimpleNamespace(org_vocab_start_index=min(rank * per, v), org_vocab_end_index=min((rank + 1) * per, v))
    return _module(weight=full[rank * per:(rank + 1) * per], shard_indices=ids, num_added_embeddings=0)


def fake_vllm_rank(weights, rank: int):
    """Rank `rank`'s vLLM model: QKVParallelLinear's q|k|v rows of its heads, MergedColumnParallelLinear's gate|up
    rows, RowParallelLinear's O and down columns, cut by head and by FFN row as vLLM's loaders cut them (written
    apart from model.tensor_parallel.shard_weights, which the test compares with)."""
    c = weights.config
    hq, hkv, f, d, h = c.num_heads // W, c.num_kv_heads // W, c.intermediate_size // W, c.head_dim, c.hidden_size
    layers = torch.nn.ModuleList()
    for lw in weights.layers:
        q = lw.qkv[:c.q_size].view(c.num_heads, d, h)[rank * hq:(rank + 1) * hq].reshape(-1, h)
        k = lw.qkv[c.q_size:c.q_size + c.kv_size].view(c.num_kv_heads, d, h)[rank * hkv:(rank + 1) * hkv]
        v = lw.qkv[c.q_size + c.kv_size:].view(c.num_kv_heads, d, h)[rank * hkv:(rank + 1) * hkv]
        gate, up = lw.gate_up[:c.intermediate_size], lw.gate_up[c.intermediate_size:]
        o = lw.o_proj.view(h, c.num_heads, d)[:, rank * hq:(rank + 1) * hq].reshape(h, -1)
        attn = dict(qkv_proj=_module(weight=torch.cat([q, k.reshape(-1, h), v.reshape(-1, h)])),
                    o_proj=_module(weight=o))
        if c.qk_norm:
            attn.update(q_norm=_module(weight=lw.q_norm), k_norm=_module(weight=lw.k_norm))
        rows = slice(rank * f, (rank + 1) * f)
        mlp = _module(gate_up_proj=_module(weight=torch.cat([gate[rows], up[rows]])),
                      down_proj=_module(weight=lw.down[:, rows]))
        layers.append(_module(input_layernorm=_module(weight=lw.attn_norm), self_attn=_module(**attn),
                              post_attention_layernorm=_module(weight=lw.mlp_norm), mlp=mlp))
    embed = _vocab_shard(weights.embed, rank)
    inner = _module(embed_tokens=embed, layers=layers, norm=_module(weight=weights.final_norm))
    return _module(model=inner, lm_head=embed if c.tie_word_embeddings else _vocab_shard(weights.lm_head, rank))


def _group(rank, group) -> vmap.TPGroup:
    return vmap.TPGroup(rank=rank, world_size=group.world_size, gather_object=group.gather_object(rank),
                        gather_rows=group.gather_rows(rank))


# ---- which models a rank serves ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config,world,needle", [
    (get_preset("llama-3.2-1b"), 2, None), (get_preset("qwen3-0.6b"), 2, None), (get_preset("llama-3.1-8b"), 8, None),
    (TP_LLAMA, 2, None), (TP_QWEN3, 2, None),
    (dataclasses.replace(TP_LLAMA, num_kv_heads=1), 2, "num_kv_heads=1 < tensor_parallel_size=2: vLLM replicates"),
    (get_preset("tiny-llama"), 2, "tensor_parallel_size=2: q_size / world_size = 128"),
    (get_preset("llama-3.2-1b"), 3, "world_size=3 is not supported"),
    (dataclasses.replace(TP_LLAMA, vocab_size=1025), 2, "vocab_size=1025 .* not divisible by world_size=2"),
    (dataclasses.replace(TP_LLAMA, vocab_size=1032), 2, "vocab_size=1032 / world_size=2 = 516 rows per rank"),
])
def test_which_models_split_for_the_kernel(config, world, needle):
    """tp_reason (heads, kv heads, shards the device code streams) and layout_reason (a rank's rows in whole row
    groups) at batch 1 and the tensor-parallel limit."""
    why = vmap.layout_reason(config, vmap.TP_MAX_BATCH, world)
    if needle is None:
        assert why is None, why
    else:
        assert why is not None and re.search(needle, why), why


# ---- the rank's weights --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [TP_LLAMA, TP_QWEN3, TP_QWEN3_1024], ids=lambda c: c.name)
def test_each_rank_reads_its_shard_and_the_whole_embedding(config):
    """weights_from_vllm on every rank (a collective) equals shard_weights of the whole model for that rank, its
    layer matrices views of the rank's parameters, with the whole embedding in vocabulary order and none of vLLM's
    padding rows; the LM head rows are views of vLLM's where its shard starts with them."""
    weights = random_weights(config, seed=13, dtype=torch.bfloat16)
    models = [fake_vllm_rank(weights, r) for r in range(W)]
    out = run_rank_threads(W, lambda r, g: vmap.weights_from_vllm(models[r], config, _group(r, g)))
    want = shard_weights(weights, W)
    for r, got in enumerate(out):
        what = f"{config.name} rank {r}"
        assert not isinstance(got, BaseException), f"{what}: {got!r}"
        assert got.config == shard_config(config, W) and got.meta == {"rank": r, "world_size": W}, what
        assert torch.equal(got.embed, weights.embed), f"{what}: the gathered embedding"
        assert torch.equal(got.lm_head, want[r].lm_head), f"{what}: LM head rows"
        for l, (a, b) in enumerate(zip(got.layers, want[r].layers)):
            for name, t in b.tensors():
                assert torch.equal(getattr(a, name), t), f"{what} layer {l} {name}"
            assert a.qkv.data_ptr() == models[r].model.layers[l].self_attn.qkv_proj.weight.data_ptr(), what
        aligned = config.vocab_size % VOCAB_PAD == 0          # no padding: each rank holds exactly V/W rows
        if not config.tie_word_embeddings:
            assert (got.lm_head.data_ptr() == models[r].lm_head.weight.data_ptr()) == aligned, what


def test_a_rank_whose_parameters_are_not_understood_stops_every_rank_before_any_gather():
    weights = random_weights(TP_LLAMA, seed=14, dtype=torch.bfloat16)
    models = [fake_vllm_rank(weights, r) for r in range(W)]
    models[1].model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    rows = []

    def fn(rank, group):
        tpg = dataclasses.replace(_group(rank, group), gather_rows=lambda t: rows.append(rank))
        return vmap.weights_from_vllm(models[rank], TP_LLAMA, tpg)

    out = run_rank_threads(W, fn)
    assert all(isinstance(e, ValueError) for e in out), out
    assert all(str(e).startswith("rank 1: vLLM parameter model.layers.1.mlp.down_proj.weight has shape (3, 3)")
               for e in out), out
    assert rows == [], "a tensor was gathered after a rank failed"


# ---- the adapter ----------------------------------------------------------------------------------------------------

def _vllm_config(config, world=W, extra=True):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=world, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype=torch.bfloat16, quantization=None, max_model_len=64,
                                     hf_config=config.to_hf_config(), model="/m"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16]),
        quant_config=None, lora_config=None, speculative_config=None,
        additional_config={vmap.CONFIG_KEY: extra})


def test_an_instance_whose_model_does_not_split_runs_stock_with_the_reason(mk_log):
    config = dataclasses.replace(TP_LLAMA, num_kv_heads=1)
    a = vm.MegakernelDecode(fake_vllm_rank(random_weights(TP_LLAMA, seed=1), 0), _vllm_config(config))
    assert a.disabled and "vLLM replicates kv heads" in a.disabled and "vLLM replicates kv heads" in "\n".join(
        mk_log.messages)


def test_a_tensor_parallel_instance_sends_batches_up_to_eight_to_the_kernel(mk_log):
    a = vm.MegakernelDecode(fake_vllm_rank(random_weights(TP_LLAMA, seed=1), 0),
                            _vllm_config(TP_LLAMA, extra={"max_batch": 32}))
    assert a.disabled is None and a.world_size == W and a.max_batch == vmap.TP_MAX_BATCH == 8
    assert a.buckets == (1, 2, 4, 8) and a.kv_config == shard_config(a.config, W)
    assert any("decode batches up to 8" in m for m in mk_log.messages)


class _FakeRankEngine:
    """Stands in for TensorParallelRank: its construction is a collective (runtime.collective, as the real one's),
    failing on the ranks in `fail`; a launch writes x[L] as a known function of the staged inputs."""

    fail: set[int] = set()
    built: list = []

    def __init__(self, shard, config, world_size, rank, batch, max_seq_len, *, gather, device, block_size,
                 kv_caches, lm_head, scratch_block, packed_weights=None):

        def build():
            if rank in _FakeRankEngine.fail:
                raise RuntimeError("cudaIpcOpenMemHandle failed")
        collective(gather, rank, world_size, f"rank {rank}: building", build)
        self.args = dict(shard=shard, config=config, world_size=world_size, rank=rank, batch=batch,
                         block_size=block_size, kv_caches=kv_caches, lm_head=lm_head, scratch_block=scratch_block,
                         packed=packed_weights)
        i32 = dict(dtype=torch.int32)
        self.bufs = SimpleNamespace(tokens=torch.zeros(batch, **i32), positions=torch.zeros(batch, **i32),
                                    block_table=torch.full((batch, 4), -5, **i32),
                                    x=torch.full((config.num_layers + 1, batch, config.hidden_size), float("nan")))
        self.launches = 0
        _FakeRankEngine.built.append(self)

    def bind_kv_caches(self, k, v):
        self.args["kv_caches"] = (k, v)

    def launch(self):
        self.launches += 1
        self.bufs.x[-1] = self.args["shard"].embed[self.bufs.tokens.long()].float()

    def check(self):
        pass


class _Attn:
    def __init__(self, kv, name):
        self.kv_cache, self.layer_name = kv, name


def _rank_adapter(weights, rank, group, reason=None, pack_error=None):
    """Rank `rank`'s adapter at weight load, with the thread group as vLLM's and a runtime check that says
    `reason` (None: a Hopper GPU with the runtime importable: here the CPU and _FakeRankEngine). -> (adapter, its
    model: the adapter holds it by a weak reference, the test keeps it alive)."""
    config = weights.config
    model = fake_vllm_rank(weights, rank)
    sc = shard_config(config, W)
    gen = torch.Generator().manual_seed(rank)
    for i, layer in enumerate(model.model.layers):
        kv = torch.randn(12, sc.num_kv_heads, 16, 2 * sc.head_dim, generator=gen).to(torch.bfloat16)
        object.__setattr__(layer.self_attn, "attn", _Attn(kv, f"model.layers.{i}.self_attn.attn"))
    a = vm.MegakernelDecode(model, _vllm_config(config, extra={"max_batch": 8}))
    a._tp_group = lambda: _group(rank, group)

    def runtime_reason(device):
        a.device, a.engine_cls = device, _FakeRankEngine
        a._fc_get, a._fc_available = (lambda: a._ctx), (lambda: True)
        return reason
    a._runtime_reason = runtime_reason
    if pack_error is not None:
        a._pack = lambda: (_ for _ in ()).throw(RuntimeError(pack_error))
    a._ctx = SimpleNamespace(attn_metadata=None)
    a.on_weights_loaded()
    return a, model


@pytest.mark.parametrize("case", ["ok", "rank 1 not Hopper", "rank 0 cannot pack"])
def test_every_rank_takes_the_same_decision_at_weight_load(case):
    """A reason on one rank (a GPU the kernel does not run on; packing that raised) disables every rank, naming it;
    otherwise every rank holds its shard, packed once."""
    weights = random_weights(TP_LLAMA, seed=17, dtype=torch.bfloat16)

    def fn(rank, group):
        return _rank_adapter(weights, rank, group,
                             reason="the GPU is sm_80" if case == "rank 1 not Hopper" and rank == 1 else None,
                             pack_error="out of memory" if case == "rank 0 cannot pack" and rank == 0 else None)

    out = run_rank_threads(W, fn)
    assert all(not isinstance(x, BaseException) for x in out), out
    adapters = [a for a, _ in out]
    want = {"ok": None, "rank 1 not Hopper": "rank 1: the GPU is sm_80",
            "rank 0 cannot pack": "rank 0: packing the weights raised RuntimeError: out of memory"}[case]
    assert [a.disabled for a in adapters] == [want] * W, case
    for r, a in enumerate(adapters):
        if want is None:
            assert a.weights.config == shard_config(a.config, W) and a.weights.meta["rank"] == r
            assert a.packed is not None and a.engine_cls is _FakeRankEngine
            # what TensorParallelRank checks the shared packed weights against: the rank's layout, whole embedding
            layout = StepLayout(config=a.config, batch=8, kv_splits=1, block_size=16, max_blocks_per_seq=4,
                                num_sms=7)
            validate_packed_weights(a.packed, ShardLayout.of(layout, W, r), device="cpu")
            assert tuple(a.packed.embed.shape) == (TP_LLAMA.vocab_size, TP_LLAMA.hidden_size)
        else:
            assert a.engine_cls is None and a.packed is None


def _decode_metadata(n: int):
    return SimpleNamespace(max_query_len=1, slot_mapping=torch.arange(n) + 20,
                           block_table=torch.arange(1, n + 1, dtype=torch.int32)[:, None].repeat(1, 4))


@pytest.mark.parametrize("failing", [set(), {1}])
def test_every_rank_builds_its_engine_or_none_does(failing):
    """The first decode batch of a bucket builds TensorParallelRank on every rank in the same forward (vLLM runs the
    same steps on every rank): over the rank's shard and the whole model's config, without LM head, on vLLM's KV
    views of the rank's kv heads, null block 0 as scratch. A build that fails on one rank fails on all (the
    constructor is collective), and every rank goes stock."""
    _FakeRankEngine.fail, _FakeRankEngine.built = set(failing), []
    weights = random_weights(TP_LLAMA, seed=19, dtype=torch.bfloat16)
    built = run_rank_threads(W, lambda r, g: _rank_adapter(weights, r, g))
    adapters = [a for a, _ in built]
    ids, pos = torch.tensor([5, 900, 17]), torch.tensor([3, 4, 5])

    def decode(rank, group):
        a = adapters[rank]
        a.tp = _group(rank, group)          # (this round's threads)
        a._ctx.attn_metadata = {f"model.layers.{i}.self_attn.attn": _decode_metadata(3) for i in range(2)}
        return a.maybe_decode(ids, pos)

    out = run_rank_threads(W, decode)
    if failing:
        assert out == [None, None] and not any(a.engines for a in adapters)
        assert all("building the batch-4 engine failed" in a.disabled and "rank 1: RuntimeError: cudaIpcOpen" in
                   a.disabled for a in adapters), [a.disabled for a in adapters]
        return
    assert all(isinstance(h, torch.Tensor) and h.shape == (3, TP_LLAMA.hidden_size) for h in out), out
    assert torch.equal(out[0], out[1]), "the ranks' hidden states differ"
    for r, a in enumerate(adapters):
        (eng,) = a.engines.values()
        args = eng.args
        assert (args["rank"], args["world_size"], args["batch"], args["lm_head"], args["scratch_block"]) == \
            (r, W, 4, False, 0)
        assert args["config"] == a.config and args["shard"] is a.weights and args["packed"] is a.packed
        k, v = args["kv_caches"]
        assert len(k) == 2 and k[0].shape == (12, 16, shard_config(a.config, W).num_kv_heads, TP_LLAMA.head_dim)
        assert eng.launches == 1 and eng.bufs.block_table[3].eq(0).all(), "the padded row's block table"


def test_an_error_on_the_decode_path_of_a_rank_is_raised_not_run_stock():
    """One rank's decode path raising must not make that rank alone run vLLM's stock layers (their all-reduces
    would meet its peer's other collectives): the error is raised, and the rank disabled."""
    _FakeRankEngine.fail, _FakeRankEngine.built = set(), []
    weights = random_weights(TP_LLAMA, seed=23, dtype=torch.bfloat16)
    built = run_rank_threads(W, lambda r, g: _rank_adapter(weights, r, g))
    a = built[0][0]
    a.engines[1] = SimpleNamespace(bufs=SimpleNamespace(tokens=torch.zeros(1, dtype=torch.int32),
                                                        positions=torch.zeros(1, dtype=torch.int32),
                                                        block_table=torch.zeros(1, 4, dtype=torch.int32)),
                                   bind_kv_caches=lambda k, v: None,
                                   launch=lambda: (_ for _ in ()).throw(RuntimeError("launch broke")))
    a._ctx.attn_metadata = {f"model.layers.{i}.self_attn.attn": _decode_metadata(1) for i in range(2)}
    with pytest.raises(RuntimeError, match="launch broke"):
        a.maybe_decode(torch.tensor([3]), torch.tensor([0]))
    assert a.disabled and "launch broke" in a.disabled


# ---- against vLLM itself ---------------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_vllms_tensor_parallel_layout_is_what_the_adapter_reads():
    """What the stand-ins above assume of vLLM 0.26: the tensor-parallel group's coordinator with its rank, CPU group
    and an all_gather along a dimension; a VocabParallelEmbedding's shard_indices, with a padded vocabulary's real
    rows first on each rank (1008 ids padded to 1024, two ranks: 0..511 and 512..1007)."""
    import inspect

    from vllm.distributed.parallel_state import GroupCoordinator, get_tp_group
    from vllm.model_executor.layers.vocab_parallel_embedding import (VocabParallelEmbedding,
                                                                     VocabParallelEmbeddingShardIndices)

    assert {"org_vocab_start_index", "org_vocab_end_index"} <= {
        f.name for f in dataclasses.fields(VocabParallelEmbeddingShardIndices)}
    assert "dim" in inspect.signature(GroupCoordinator.all_gather).parameters
    init = inspect.getsource(GroupCoordinator.__init__)
    assert "self.cpu_group" in init and "self.rank_in_group" in init
    ids = [VocabParallelEmbedding._get_indices(1024, 1024, 1008, 1008, r, 2) for r in range(2)]
    assert [(i.org_vocab_start_index, i.org_vocab_end_index) for i in ids] == [(0, 512), (512, 1008)]
    assert "self.shard_indices" in inspect.getsource(VocabParallelEmbedding.__init__) and callable(get_tp_group)

"""The `megakernel` command: help texts, info, generate (checked against the reference decoder), bench,
and errors for bad input raised before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megakernel import cli
from megakernel.integrations.floor import floor_ms
from megakernel.model.presets import get_preset
from megakernel.model.reference import ReferenceDecoder
from megakernel.model.weights import random_weights

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def _run(capsys, argv):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _parse(stdout: str, label: str) -> list[list[int]]:
    rows = [line.split(":", 1)[1].split() for line in stdout.splitlines() if line.startswith(f"{label} ")]
    return [[int(t) for t in row] for row in rows]


def _reference_tokens(preset: str, seed: int, prompts, new_tokens: int) -> list[list[int]]:
    weights = random_weights(get_preset(preset), seed=seed, dtype=torch.float32)
    return ReferenceDecoder(weights).generate(prompts, new_tokens, return_logits=False).tokens


@pytest.mark.parametrize("argv, expected", [
    ([], ["generate", "bench", "info", "main job"]),
    (["generate"], ["--preset", "--model-dir", "--prompt-ids", "--prompt", "--max-new-tokens", "--batch",
                    "--backend", "tiny-qwen3"]),
    (["bench"], ["--batch", "--steps", "--json", "read floor"]),
    (["info"], ["--preset", "SMs"]),
])
def test_help(capsys, argv, expected):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in expected:
        assert word in text, f"`megakernel {' '.join(argv)} --help` lacks {word!r}"


def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megakernel", "--version"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import megakernel
    assert proc.stdout.strip() == f"megakernel {megakernel.__version__}"


def test_info_with_preset(capsys):
    rc, out, _ = _run(capsys, ["info", "--preset", "tiny-qwen3", "--bandwidth", "2.5"])
    assert rc == 0
    cfg = get_preset("tiny-qwen3")
    assert f"torch {torch.__version__}" in out
    assert f"weights {cfg.weight_bytes(2):,} " in out
    assert f"{floor_ms(cfg, 1, 2.5e12):.3f} ms/step" in out
    if not torch.cuda.is_available():
        assert "GPU: none" in out


def test_info_names_the_k_ranges_only_past_the_megakernels_batch(capsys):
    """Batch 32: the K ranges the schedule and the VM split each layer matvec into (split_k.k_splits on the
    SMs of the GPU, or the H200's 132); batch 8, which the megakernel runs whole: no such line."""
    from megakernel.instructions.layout import StepLayout
    from megakernel.instructions.split_k import SPLIT_STAGES, k_splits

    rc, out, _ = _run(capsys, ["info", "--preset", "llama-3.1-8b", "--batch", "32"])
    assert rc == 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    layout = StepLayout(config=get_preset("llama-3.1-8b"), batch=32, kv_splits=1, block_size=16,
                        max_blocks_per_seq=1, num_sms=sms)
    want = ", ".join(f"{op.name} {k_splits(layout, op)}" for op in SPLIT_STAGES)
    assert f"K ranges per layer matvec on {sms} SMs: {want}" in out, out
    if sms == 132:      # docs/batch_path.md's table
        assert want == "QKV 4, O_PROJ 4, DOWN 8", want
    rc, out, _ = _run(capsys, ["info", "--preset", "llama-3.1-8b", "--batch", "8"])
    assert rc == 0 and "K ranges" not in out, out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_generate_reference_matches_decoder(capsys, preset):
    seed, new = 7, 6
    rc, out, _ = _run(capsys, ["generate", "--preset", preset, "--backend", "reference", "--seed", str(seed),
                               "--prompt-ids", "3,1,4;1,5,9,2,6", "--max-new-tokens", str(new)])
    assert rc == 0
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    assert _parse(out, "prompt") == prompts
    assert _parse(out, "seq") == _reference_tokens(preset, seed, prompts, new), f"preset={preset} seed={seed}"
    assert "tok/s" in out


def test_generate_torch_eager_batch_repeats_prompt(capsys):
    seed, new = 3, 5
    rc, out, _ = _run(capsys, ["generate", "--preset", "tiny-llama", "--backend", "torch-eager", "--seed",
                               str(seed), "--prompt-ids", "10,20,30", "--batch", "3", "--max-new-tokens", str(new)])
    assert rc == 0
    expected = _reference_tokens("tiny-llama", seed, [[10, 20, 30]], new)[0]
    assert _parse(out, "seq") == [expected] * 3, f"tiny-llama seed={seed} batch=3"


@needs_no_cuda
def test_main_job_without_gpu(capsys):
    rc, out, err = _run(capsys, [])
    assert rc == 0
    assert "no CUDA device" in err and "tiny-llama" in err
    prompts = _parse(out, "prompt")
    assert len(prompts) == 1 and len(prompts[0]) == cli.DEFAULT_PROMPT_LEN
    assert _parse(out, "seq") == _reference_tokens("tiny-llama", 0, prompts, 64)
    assert "backend reference" in out


def test_generate_from_model_dir_with_tokenizer(capsys, tmp_path):
    """--model-dir loads config.json + safetensors; --prompt goes through the local tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megakernel.model.weights import save_checkpoint

    seed, new = 11, 4
    weights = random_weights(get_preset("tiny-qwen3"), seed=seed, dtype=torch.float32)
    save_checkpoint(tmp_path, weights)
    vocab = {w: i for i, w in enumerate(["<unk>", "the", "cat", "sat", "on", "mat"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path)
    rc, out, _ = _run(capsys, ["generate", "--model-dir", str(tmp_path), "--prompt", "the cat sat",
                               "--backend", "reference", "--max-new-tokens", str(new)])
    assert rc == 0
    assert _parse(out, "prompt") == [[1, 2, 3]]
    expected = ReferenceDecoder(weights).generate([[1, 2, 3]], new, return_logits=False).tokens
    assert _parse(out, "seq") == expected, f"tiny-qwen3 checkpoint seed={seed}"
    assert "text 0: 'the cat sat" in out


def test_bench_on_cpu(capsys, tmp_path):
    path = tmp_path / "bench.json"
    rc, out, err = _run(capsys, ["bench", "--preset", "tiny-qwen3", "--batch", "1,2", "--steps", "3",
                                 "--context", "2", "--backends", "reference,torch-eager", "--device", "cpu",
                                 "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    rows = {(r["backend"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(b, n) for b in ("reference", "torch-eager") for n in (1, 2)}
    for (name, batch), row in rows.items():
        assert row["error"] is None, row
        # Both run float32 on the CPU: torch-eager must produce the reference's tokens.
        assert row["tokens_agree"] == 1.0, f"{name} batch {batch}: tokens differ from the reference"
        assert row["tokens_per_s"] == pytest.approx(batch * 1e3 / row["ms_per_step"])
    assert rows[("reference", 1)]["speedup"].keys() == {"torch-eager"}
    assert report["read_bandwidth"] is None and report["floor_ms"] == {}
    assert "torch-eager" in out and "ms/step" in out


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if weights are built: input errors must come before any work."""
    import megakernel.model.weights as weights_mod

    def refuse(*args, **kwargs):
        raise AssertionError("weights were built before the input was checked")

    monkeypatch.setattr(weights_mod, "random_weights", refuse)
    monkeypatch.setattr(weights_mod, "load_checkpoint", refuse)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--preset", "llama-9"], "unknown model preset 'llama-9'"),
    (["generate", "--backend", "cublas"], "unknown backend 'cublas'"),
    (["generate", "--preset", "tiny-qwen3", "--prompt-ids", "1,2", "--max-new-tokens", "40960"],
     "past max_seq_len"),
    (["generate", "--preset", "tiny-llama", "--backend", "reference", "--batch", "65"], "too large"),
    (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["generate", "--prompt-ids", "1,;"], "at least one token"),
    (["generate", "--preset", "tiny-llama", "--prompt-ids", "1,1024"], "outside the vocabulary"),
    (["generate", "--prompt-ids", "1;2;3", "--batch", "2"], "does not match the 3 prompts"),
    (["generate", "--batch", "0"], "--batch must be >= 1"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "hello"], "needs a tokenizer"),
    (["generate", "--model-dir", "/nonexistent/dir"], "no config.json"),
    (["bench", "--steps", "0"], "steps >= 1"),
    (["bench", "--backends", "reference,cublas"], "unknown backend 'cublas'"),
    (["info", "--preset", "llama-9"], "unknown model preset"),
    (["bench", "--kernel-options", "bogus=1"], "kernel option 'bogus=1': expected KEY=VALUE"),
    (["bench", "--kernel-options", "timeout_ns=x"], "timeout_ns takes an integer"),
    (["bench", "--kernel-options", "fold_embed=yes"], "fold_embed takes 0/1/true/false"),
    (["bench", "--kernel-options", "fold_embed"], "expected KEY=VALUE"),
])
def test_bad_input_fails_before_work(capsys, no_work, argv, message):
    rc, _, err = _run(capsys, argv)
    assert rc == 2, argv
    assert err.startswith("megakernel: error:"), err
    assert message in err, f"{argv}: {err}"


@needs_no_cuda
@pytest.mark.parametrize("backend", ["megakernel", "torch-graph", "torch-compile"])
def test_gpu_backend_without_gpu_says_why(capsys, no_work, backend):
    rc, _, err = _run(capsys, ["generate", "--backend", backend])
    assert rc == 2
    assert "needs a CUDA GPU" in err and "no CUDA device" in err, err


def test_info_deepseek_preset_reports_moe_bytes(capsys):
    """MoE floor: the routed-expert bytes follow the expected distinct experts of the batch."""
    from megakernel.model.deepseek.floor import decode_bytes
    from megakernel.model.deepseek.presets import get_preset

    rc, out, _ = _run(capsys, ["info", "--preset", "moonlight-16b-a3b", "--batch", "8", "--bandwidth", "4"])
    assert rc == 0, out
    parts = decode_bytes(get_preset("moonlight-16b-a3b"), 8, 2, 0)
    assert f"{parts['routed_experts'] / 1e9:10.3f} GB" in out, out
    assert f"{parts['total'] / 4e12 * 1e3:.3f} ms/step" in out, out
    rc1, out1, _ = _run(capsys, ["info", "--preset", "moonlight-16b-a3b", "--batch", "1", "--bandwidth", "4"])
    one = decode_bytes(get_preset("moonlight-16b-a3b"), 1, 2, 0)
    assert one["routed_experts"] < parts["routed_experts"], "batch 8 must touch more experts than batch 1"
    assert f"{one['total'] / 1e9:10.3f} GB" in out1, out1


def test_info_rejects_bad_batch(capsys):
    assert cli.main(["info", "--preset", "tiny-llama", "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err


def test_kernel_options_parse_into_engine_keywords():
    from megakernel.kernel.interpreter import KernelOptions
    from megakernel.runtime.engine import parse_engine_options

    kw = parse_engine_options("timeout_ns=5000, fold_embed=false,kv_splits=3,policy=round-robin")
    assert kw == {"fold_embed": False, "kv_splits": 3, "policy": "round-robin",
                  "options": KernelOptions(timeout_ns=5000)}
    with pytest.raises(ValueError, match="lm_pool_rows"):   # the LM head pool is gone (profiles/RESULTS.md)
        parse_engine_options("lm_pool_rows=32")
    assert parse_engine_options("") == {} and parse_engine_options("kv_splits=2") == {"kv_splits": 2}
    with pytest.raises(ValueError, match="trace"):        # trace mode is not a benchmark option
        parse_engine_options("trace=1")


def test_bench_passes_kernel_options_to_the_megakernel_backend_only(monkeypatch):
    """run_bench hands the parsed options to the megakernel backend's constructor and no other, and says so
    in the report's notes."""
    from megakernel.integrations import backends, bench
    from megakernel.runtime.engine import parse_engine_options

    seen = {}
    real = backends.get_backend

    def spy(name, weights, device, **kw):
        seen[name] = kw
        if name == "megakernel":
            raise backends.BackendUnavailable("no GPU in this test")
        return real(name, weights, device, **kw)

    monkeypatch.setattr(backends, "get_backend", spy)
    opts = parse_engine_options("fold_embed=0,timeout_ns=5000")
    report = bench.run_bench(preset="tiny-llama", batches=(1,), steps=2, context=2,
                             backend_names=("reference", "megakernel"), device="cpu", megakernel_options=opts)
    assert seen == {"reference": {}, "megakernel": opts}
    rows = {r.backend: r for r in report.rows}
    assert rows["reference"].error is None and "no GPU in this test" in rows["megakernel"].error
    assert any("fold_embed=False" in n and "timeout_ns=5000" in n for n in report.notes), report.notes


def test_model_dir_without_safetensors_fails_before_work(capsys, no_work, tmp_path):
    """config.json but no weights (a download that stopped half way, a .bin checkpoint): exit 2 and what to
    do, not a traceback."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    rc, _, err = _run(capsys, ["generate", "--model-dir", str(tmp_path), "--prompt-ids", "1,2"])
    assert rc == 2 and err.startswith("megakernel: error:"), err
    assert "no *.safetensors" in err and ".bin checkpoints are not read" in err, err


@needs_no_cuda
def test_bench_of_gpu_backends_only_without_a_gpu_exits_2_before_work(capsys, no_work):
    """--backends naming only GPU backends on a machine without one: nothing could run, so exit 2 with the
    reason before any weights are built (it used to print an empty table, exit 0 and say the CPU ran)."""
    rc, out, err = _run(capsys, ["bench", "--backends", "megakernel,torch-graph", "--steps", "2"])
    assert rc == 2, (out, err)
    assert "needs a CUDA GPU" in err and "'megakernel'" in err and "'torch-graph'" in err, err


@needs_no_cuda
def test_bench_notes_name_the_backends_asked_for(capsys):
    rc, out, _ = _run(capsys, ["bench", "--backends", "reference", "--steps", "2", "--context", "2"])
    assert rc == 0, out
    assert "no CUDA device: reference on the tiny-llama preset" in out and "torch-eager" not in out, out


@pytest.mark.parametrize("what,tokens,positions", [
    ("tokens", torch.tensor([1.0, 2.0]), torch.tensor([0, 0])),
    ("positions", torch.tensor([1, 2]), torch.tensor([0.0, 3.0])),
    ("tokens", torch.tensor([True, False]), torch.tensor([0, 0])),
])
def test_step_inputs_that_are_not_integer_ids_are_refused(what, tokens, positions):
    """engine.step / set_inputs validate with validate_step_inputs: float (or bool) ids are an error, not
    silently truncated."""
    from megakernel.instructions.layout import StepLayout, validate_step_inputs

    layout = StepLayout(config=get_preset("tiny-llama"), batch=2, kv_splits=1, block_size=16, max_blocks_per_seq=2,
                        num_sms=4)
    with pytest.raises(ValueError, match=f"{what} must be integer ids"):
        validate_step_inputs(layout, tokens, positions)
    validate_step_inputs(layout, torch.tensor([1, 2]), torch.tensor([0, 3]))

"""The `megakernel` command: generate, bench, info.

`megakernel` with no arguments runs the main job: greedy generation on the embedded default preset
(llama-3.2-1b shape, seeded random weights) with the megakernel backend on a GPU; without a GPU it runs
the float32 torch reference on the tiny-llama preset and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

import megakernel

DEFAULT_PRESET = "llama-3.2-1b"
CPU_PRESET = "tiny-llama"
DEFAULT_PROMPT_LEN = 16
MAX_BATCH = 64


class InputError(ValueError):
    """Bad input, reported before any work is done."""


def _eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


class Progress:
    """Progress lines on stderr, only once a run has taken more than `after_s` seconds."""

    def __init__(self, label: str, after_s: float = 2.0, every_s: float = 1.0):
        self.label, self.after_s, self.every_s = label, after_s, every_s
        self.t0 = time.monotonic()
        self.last = None
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        elapsed = now - self.t0
        if elapsed < self.after_s or (self.last is not None and now - self.last < self.every_s and done < total):
            return
        self.last = now
        self.shown = True
        _eprint(f"{self.label}: step {done}/{total} ({100 * done // total}%), {elapsed:.1f} s")


# -- argument parsing ------------------------------------------------------------------------------------

def _preset_names() -> list[str]:
    from megakernel.model.presets import PRESETS

    return list(PRESETS)


def _backend_names() -> list[str]:
    from megakernel.integrations.backends import BACKENDS

    return list(BACKENDS)


def build_parser() -> argparse.ArgumentParser:
    presets = ", ".join(_preset_names())
    backends = ", ".join(_backend_names())
    parser = argparse.ArgumentParser(
        prog="megakernel",
        description=("A persistent CuTe DSL decode megakernel for Llama/Qwen3 models, with plain torch "
                     "baselines to compare against. Without a subcommand, runs the main job: `generate` on the "
                     f"embedded {DEFAULT_PRESET} preset (seeded random weights) with the megakernel backend "
                     f"on a GPU, or, without a GPU, the float32 torch reference on {CPU_PRESET}."),
        epilog="Run `megakernel SUBCOMMAND --help` for the options of each subcommand.",
    )
    parser.add_argument("--version", action="version", version=f"megakernel {megakernel.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")

    gen = sub.add_parser(
        "generate", help="greedy generation with one backend; prints the tokens and tok/s",
        description=("Greedy generation with one backend. The prompt is prefilled as decode steps, then\n"
                     "--max-new-tokens tokens are generated per sequence; prints the prompt and new tokens\n"
                     "of every sequence and the median decode step time. The weights are a preset's shape\n"
                     "with seeded random values, or a local Hugging Face checkpoint (--model-dir)."),
        epilog=("Examples:  megakernel generate --preset tiny-qwen3 --backend reference --prompt-ids 1,2,3\n"
                "           megakernel generate --prompt-ids '5,6,7;8,9' --backend torch-graph\n"
                "           megakernel generate --model-dir ./Llama-3.2-1B --prompt 'The capital of France'"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"model shape with seeded random weights ({presets}); default "
                                      f"{DEFAULT_PRESET} on a GPU, {CPU_PRESET} without")
    src.add_argument("--model-dir", help="a local checkpoint: config.json + *.safetensors (and a tokenizer "
                                         "for --prompt)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", help="comma-separated token ids; ';' separates the prompts of a batch, "
                                             "which may differ in length (default: seeded random, "
                                             f"{DEFAULT_PROMPT_LEN} tokens)")
    prompt.add_argument("--prompt", help="prompt text, tokenized with the tokenizer in --model-dir")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sequence (default 64)")
    gen.add_argument("--batch", type=int, default=None,
                     help="number of sequences; a single prompt is repeated (default: number of prompts, or 1)")
    gen.add_argument("--backend", default=None, help=f"one of {backends}; default megakernel on a GPU, "
                                                     "reference without")
    _common(gen)

    bench = sub.add_parser(
        "bench", help="time the backends side by side against the read-bandwidth floor",
        description=("Times every available backend on one preset: a --context-token prompt, then --steps "
                     "decode steps, each timed with CUDA events (median ms/step). The table gives ms/step, "
                     "tok/s, effective GB/s, the fraction of the read floor (weights + KV bytes / the pure-read "
                     "bandwidth measured in the same run) and the speedup over each torch baseline. Without a "
                     f"GPU it runs reference and torch-eager on {CPU_PRESET} and says so."))
    bench.add_argument("--preset", help=f"model shape ({presets}); default {DEFAULT_PRESET} on a GPU, "
                                        f"{CPU_PRESET} without")
    bench.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    bench.add_argument("--steps", type=int, default=128, help="decode steps timed (default 128)")
    bench.add_argument("--context", type=int, default=32, help="prompt tokens before the timed steps (default 32)")
    bench.add_argument("--backends", help=f"comma-separated subset of {backends} (default: the torch baselines "
                                          "and the megakernel on a GPU; reference and torch-eager without)")
    bench.add_argument("--compile-mode", default=None,
                       help="torch.compile mode for torch-compile (default 'default'; e.g. "
                            "max-autotune-no-cudagraphs)")
    bench.add_argument("--kernel-options", metavar="KEY=VALUE,...",
                       help="options of the megakernel backend: KernelOptions fields (timeout_ns=500000000) "
                            "and the engine's layout options (fold_embed=0, kv_splits=2, policy=round-robin); "
                            "checked before anything runs")
    bench.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")
    _common(bench, dtype=False)

    info = sub.add_parser(
        "info", help="GPU, software versions; with --preset, weight bytes and the read floor",
        description=("Prints the GPU (name, SMs, memory) and the torch, CUDA, nvidia-cutlass-dsl and "
                     "transformers versions. With --preset: the model's shape, the bytes one decode step must "
                     "read and the read floor (measured bandwidth on a GPU, or --bandwidth)."))
    info.add_argument("--preset", help=f"also describe this preset ({presets}; or a DeepSeek/Kimi-K2 one: "
                                       f"{', '.join(_deepseek_presets())}; or a Kimi Linear one: "
                                       f"{', '.join(_kimi_linear_presets())})")
    info.add_argument("--batch", type=int, default=1,
                      help="sequences per step for the bytes and the floor (default 1; MoE: the expected "
                           "distinct experts of this many tokens under uniform routing; 16-64: also the K ranges "
                           "the schedule splits each layer matvec into)")
    info.add_argument("--context", type=int, default=0, help="cached tokens per sequence (default 0)")
    info.add_argument("--bandwidth", type=float, metavar="TB_PER_S",
                      help="compute the floor at this read bandwidth instead of measuring it")
    return parser


def _common(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument("--device", default=None, help="torch device (default cuda when present, else cpu)")
    if dtype:
        p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                       help="weight dtype (default bfloat16 on a GPU, float32 on the CPU)")


# -- resolving the input ----------------------------------------------------------------------------------

def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve_device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if _cuda_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InputError(f"bad --device {name!r}: {exc}") from None
    if device.type == "cuda" and not _cuda_available():
        raise InputError(f"--device {name}: no CUDA device is present")
    return device


def _get_config(preset: str | None, model_dir: str | None):
    from megakernel.model.config import ModelConfig
    from megakernel.model.presets import get_preset

    if model_dir is not None:
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise InputError(f"--model-dir {model_dir}: no config.json there")
        try:
            config = ModelConfig.from_pretrained(model_dir)
        except ValueError as exc:
            raise InputError(f"--model-dir {model_dir}: {exc}") from None
        if not any(name.endswith(".safetensors") for name in os.listdir(model_dir)):
            raise InputError(f"--model-dir {model_dir}: config.json but no *.safetensors weights there; download "
                             f"the checkpoint's .safetensors files (all shards, with model.safetensors.index.json) "
                             f"next to it (.bin checkpoints are not read)")
        return config
    try:
        return get_preset(preset)
    except (ValueError, KeyError) as exc:
        raise InputError(str(exc).strip("'\"")) from None


def _load_tokenizer(model_dir: str | None):
    if model_dir is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # no tokenizer files, or files transformers cannot read: run without text
        return None


def _parse_prompt_ids(text: str) -> list[list[int]]:
    prompts = []
    for part in text.split(";"):
        try:
            ids = [int(tok) for tok in part.replace(" ", "").split(",") if tok != ""]
        except ValueError:
            raise InputError(f"--prompt-ids {text!r}: expected comma-separated integers, ';' between "
                             f"prompts") from None
        if not ids:
            raise InputError(f"--prompt-ids {text!r}: every prompt needs at least one token id")
        prompts.append(ids)
    return prompts


# -- subcommands ---------------------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace, main_job: bool = False) -> int:
    import torch

    from megakernel.integrations import backends as bk

    # Everything about the input is checked here, before weights are built.
    device = _resolve_device(args.device)
    on_gpu = device.type == "cuda"
    preset = args.preset
    if preset is None and args.model_dir is None:
        preset = DEFAULT_PRESET if on_gpu else CPU_PRESET
    backend_name = args.backend or ("megakernel" if on_gpu else "reference")
    if main_job and not on_gpu:
        _eprint(f"megakernel: no CUDA device here, so this runs the float32 torch reference decoder on the "
                f"{CPU_PRESET} preset (seeded random weights), not the megakernel on {DEFAULT_PRESET}.")
    config = _get_config(preset, args.model_dir)
    if backend_name not in bk.BACKENDS:
        raise InputError(f"unknown backend {backend_name!r}; choose one of: {', '.join(bk.BACKENDS)}")
    bk.check_backend(backend_name, device)

    if args.batch is not None and args.batch < 1:
        raise InputError(f"--batch must be >= 1, got {args.batch}")
    tokenizer = _load_tokenizer(args.model_dir)
    prompts = None
    if args.prompt is not None:
        if tokenizer is None:
            raise InputError("--prompt needs a tokenizer: pass --model-dir with tokenizer files "
                             "(or give token ids with --prompt-ids)")
        prompts = [list(tokenizer(args.prompt, add_special_tokens=True)["input_ids"])]
        if not prompts[0]:
            raise InputError("--prompt tokenized to no tokens")
    elif args.prompt_ids is not None:
        prompts = _parse_prompt_ids(args.prompt_ids)
    batch = args.batch if args.batch is not None else (len(prompts) if prompts else 1)
    if prompts is not None and len(prompts) == 1:
        prompts = prompts * batch
    if prompts is not None and batch != len(prompts):
        raise InputError(f"--batch {batch} does not match the {len(prompts)} prompts given")
    cap = bk.backend_max_batch(backend_name)
    cap = MAX_BATCH if cap is None else min(cap, MAX_BATCH)
    if batch > cap:
        raise InputError(f"batch {batch} is too large: backend {backend_name} takes at most {cap} sequences")
    if prompts is None:
        gen = torch.Generator().manual_seed(args.seed + 1)
        prompts = torch.randint(0, config.vocab_size, (batch, DEFAULT_PROMPT_LEN), generator=gen).tolist()
    bad = sorted({t for p in prompts for t in p if not 0 <= t < config.vocab_size})
    if bad:
        raise InputError(f"token ids {bad[:8]} are outside the vocabulary [0, {config.vocab_size}) of {config.name}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    longest = max(len(p) for p in prompts)
    last_position = longest + args.max_new_tokens - 2
    if last_position >= config.max_position_embeddings:
        raise InputError(f"a {longest}-token prompt plus {args.max_new_tokens} new tokens reaches position "
                         f"{last_position}, past max_seq_len = max_position_embeddings = "
                         f"{config.max_position_embeddings} of {config.name}")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if on_gpu else "float32")]

    # The work.
    t0 = time.monotonic()
    if args.model_dir is not None:
        from megakernel.model.weights import load_checkpoint

        _eprint(f"loading {args.model_dir} ({config.weight_bytes(dtype.itemsize) / 1e9:.2f} GB in {dtype})...")
        try:
            weights = load_checkpoint(args.model_dir, dtype=dtype, device=device)
        except ValueError as exc:
            raise InputError(f"--model-dir {args.model_dir}: {exc}") from None
        source = args.model_dir
    else:
        from megakernel.model.weights import random_weights

        if config.weight_bytes(dtype.itemsize) > 1e8:
            _eprint(f"building seeded random weights for {preset} "
                    f"({config.weight_bytes(dtype.itemsize) / 1e9:.2f} GB in {dtype})...")
        weights = random_weights(config, seed=args.seed, dtype=dtype, device=device)
        source = f"preset {preset} (random weights, seed {args.seed})"
    backend = bk.get_backend(backend_name, weights, device)
    if time.monotonic() - t0 > 2:
        _eprint(f"weights and backend ready in {time.monotonic() - t0:.1f} s")
    out = bk.generate(backend, prompts, args.max_new_tokens, progress=Progress("generate"))

    for i, (prompt_ids, new) in enumerate(zip(prompts, out.tokens)):
        print(f"prompt {i}: " + " ".join(str(t) for t in prompt_ids))
        print(f"seq {i}: " + " ".join(str(t) for t in new))
        if tokenizer is not None:
            print(f"text {i}: {tokenizer.decode(prompt_ids + new)!r}")
    print(f"backend {backend_name} on {device} ({dtype}), {source}: batch {batch}, "
          f"{out.prefill_steps} prefill steps + {args.max_new_tokens} decode steps; "
          f"median decode step {out.median_decode_ms:.3f} ms, {out.tokens_per_s:,.1f} tok/s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from megakernel.integrations import bench

    try:
        batches = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        raise InputError(f"--batch {args.batch!r}: expected comma-separated integers") from None
    names = tuple(n.strip() for n in args.backends.split(",")) if args.backends else None
    device = _resolve_device(args.device)
    config = _get_config(args.preset or (bench.DEFAULT_PRESET if device.type == "cuda" else bench.CPU_PRESET), None)
    try:
        bench.check_bench_args(config, batches, args.steps, args.context, names)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    mk_options = None
    if args.kernel_options:
        from megakernel.runtime.engine import parse_engine_options
        try:
            mk_options = parse_engine_options(args.kernel_options)
        except (ValueError, TypeError) as exc:
            raise InputError(f"--kernel-options: {exc}") from None
    if names:
        from megakernel.integrations.backends import BackendUnavailable, check_backend
        why = []
        for name in names:
            try:
                check_backend(name, device)
            except BackendUnavailable as exc:
                why.append(str(exc))
        if len(why) == len(names):      # nothing asked for can run here: say so before building weights
            raise InputError("; ".join(why))
    if device.type != "cuda":
        _eprint(f"megakernel bench: no CUDA device: timing {', '.join(names or bench.CPU_BACKENDS)} on "
                f"{args.preset or bench.CPU_PRESET} on the CPU; these are not GPU figures")
    t0 = time.monotonic()
    report = bench.run_bench(preset=args.preset, batches=batches, steps=args.steps, context=args.context,
                             backend_names=names, device=device, seed=args.seed, compile_mode=args.compile_mode,
                             megakernel_options=mk_options,
                             log=lambda msg: _eprint(f"[{time.monotonic() - t0:6.1f} s] {msg}"))
    print(bench.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
        _eprint(f"wrote {args.json}")
    if not any(row.error is None for row in report.rows):
        raise InputError("no backend ran (each row says why); on a machine without a GPU, "
                         "--backends reference,torch-eager runs on the CPU")
    return 0


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    print(f"megakernel {megakernel.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"transformers {_version('transformers')}, nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}")
    cuda = torch.cuda.is_available()
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.1f} GiB")
    else:
        print("GPU: none (torch.cuda.is_available() is False)")
    if args.preset is None:
        return 0
    if args.batch < 1 or args.context < 0:
        raise InputError(f"--batch must be >= 1 and --context >= 0, got {args.batch} and {args.context}")
    if args.preset in _deepseek_presets():
        return _info_deepseek(args, cuda)
    if args.preset in _kimi_linear_presets():
        return _info_kimi_linear(args, cuda)
    config = _get_config(args.preset, None)
    from megakernel.integrations.floor import floor_ms, measure_read_bandwidth

    print(f"preset {args.preset}: {config.architecture}, hidden {config.hidden_size}, {config.num_layers} layers, "
          f"{config.num_heads}/{config.num_kv_heads} heads, head_dim {config.head_dim}, "
          f"ffn {config.intermediate_size}, vocab {config.vocab_size}, "
          f"{'tied' if config.tie_word_embeddings else 'untied'} embeddings, qk_norm {config.qk_norm}")
    wbytes = config.weight_bytes(2)
    kv_token = config.num_layers * 2 * config.kv_size * 2
    print(f"bytes read per decode step (bf16): weights {wbytes:,} ({wbytes / 1e9:.3f} GB), "
          f"plus {kv_token:,} bytes of KV per token of context per sequence")
    _print_k_splits(config, args.batch, torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132)
    if args.bandwidth is not None:
        if args.bandwidth <= 0:
            raise InputError(f"--bandwidth must be positive, got {args.bandwidth}")
        bw, how = args.bandwidth * 1e12, "given with --bandwidth"
    elif cuda:
        _eprint("measuring the read bandwidth (sum over 2 GiB of bf16)...")
        bw, how = measure_read_bandwidth(device="cuda"), "measured now on GPU 0"
    else:
        print("read floor: no GPU to measure the bandwidth on (pass --bandwidth TB_PER_S to compute it)")
        return 0
    print(f"read floor at {bw / 1e12:.2f} TB/s ({how}): {floor_ms(config, args.batch, bw, args.context):.3f} "
          f"ms/step at batch {args.batch}, context {args.context}")
    return 0


def _print_k_splits(config, batch: int, num_sms: int) -> None:
    """Past SPLIT_BATCH: how the layer matvecs are split over K."""
    from megakernel.instructions.layout import MAX_BATCH, SPLIT_BATCH, StepLayout
    from megakernel.instructions.split_k import SPLIT_STAGES, k_splits

    if not SPLIT_BATCH < batch <= MAX_BATCH:
        return
    layout = StepLayout(config=config, batch=batch, kv_splits=1, block_size=16, max_blocks_per_seq=1,
                        num_sms=num_sms)
    splits = ", ".join(f"{op.name} {k_splits(layout, op)}" for op in SPLIT_STAGES)
    print(f"batch {batch} is past {SPLIT_BATCH}: K ranges per layer matvec on {num_sms} SMs: {splits} "
          f"(docs/batch_path.md)")


def _deepseek_presets() -> list[str]:
    from megakernel.model.deepseek.presets import PRESETS
    return sorted(PRESETS)


def _kimi_linear_presets() -> list[str]:
    from megakernel.model.kimi_linear.presets import PRESETS
    return sorted(PRESETS)


def _read_bandwidth(args: argparse.Namespace, cuda: bool) -> tuple[float | None, str]:
    from megakernel.integrations.floor import measure_read_bandwidth
    if args.bandwidth is not None:
        if args.bandwidth <= 0:
            raise InputError(f"--bandwidth must be positive, got {args.bandwidth}")
        return args.bandwidth * 1e12, "given with --bandwidth"
    if cuda:
        _eprint("measuring the read bandwidth (sum over 2 GiB of bf16)...")
        return measure_read_bandwidth(device="cuda"), "measured now on GPU 0"
    return None, ""


def _info_deepseek(args: argparse.Namespace, cuda: bool) -> int:
    """The bytes a DeepSeek/Kimi (MLA + MoE) decode step must read at a batch, part by part."""
    from megakernel.model.deepseek.floor import decode_bytes, expected_distinct_experts
    from megakernel.model.deepseek.presets import get_preset

    c = get_preset(args.preset)
    print(f"preset {args.preset}: DeepseekV3ForCausalLM, hidden {c.hidden_size}, {c.num_layers} layers "
          f"({c.first_k_dense_replace} dense), {c.num_heads} heads, MLA kv_lora_rank {c.kv_lora_rank}, "
          f"q_lora_rank {c.q_lora_rank}, {c.n_routed_experts} routed experts (top-{c.num_experts_per_tok}), "
          f"{c.n_shared_experts} shared, expert ffn {c.moe_intermediate_size}, vocab {c.vocab_size}")
    parts = decode_bytes(c, args.batch, 2, args.context)
    experts = expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, args.batch)
    return _print_decode_bytes(args, cuda, parts, experts, "read")


def _info_kimi_linear(args: argparse.Namespace, cuda: bool) -> int:
    """The bytes a Kimi Linear (KDA + MLA + MoE) decode step must move at a batch, part by part: the KDA
    state counted twice (read, then written back)."""
    from megakernel.model.kimi_linear.floor import decode_bytes, expected_distinct_experts
    from megakernel.model.kimi_linear.presets import get_preset

    c = get_preset(args.preset)
    print(f"preset {args.preset}: KimiLinearForCausalLM, hidden {c.hidden_size}, {c.num_layers} layers "
          f"({c.num_kda_layers} KDA, {c.num_mla_layers} MLA without RoPE; {c.num_layers - c.num_moe_layers} "
          f"dense MLP), KDA {c.linear_num_heads} heads x {c.linear_head_dim}, conv {c.linear_conv_kernel_dim}, "
          f"MLA {c.num_heads} heads kv_lora_rank {c.kv_lora_rank}, {c.n_routed_experts} routed experts "
          f"(top-{c.num_experts_per_tok}), {c.n_shared_experts} shared, expert ffn {c.moe_intermediate_size}, "
          f"vocab {c.vocab_size}")
    parts = decode_bytes(c, args.batch, 2, args.context)
    experts = expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, args.batch)
    return _print_decode_bytes(args, cuda, parts, experts, "moved")


def _print_decode_bytes(args: argparse.Namespace, cuda: bool, parts: dict, experts: float, verb: str) -> int:
    """The table of a decode step's bytes by part, then the floor at the measured or given bandwidth."""
    from megakernel.model.deepseek.floor import floor_ms
    print(f"bytes {verb} per decode step at batch {args.batch}, context {args.context} (bf16; {experts:.1f} "
          f"distinct routed experts per MoE layer expected under uniform routing):")
    for name, value in parts.items():
        if name != "total":
            print(f"  {name:17s} {value / 1e9:10.3f} GB")
    print(f"  {'total':17s} {parts['total'] / 1e9:10.3f} GB")
    bw, how = _read_bandwidth(args, cuda)
    if bw is None:
        print("read floor: no GPU to measure the bandwidth on (pass --bandwidth TB_PER_S to compute it)")
        return 0
    print(f"read floor at {bw / 1e12:.2f} TB/s ({how}): {floor_ms(parts, bw):.3f} ms/step")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megakernel.integrations.backends import BackendUnavailable

    try:
        if args.command is None:   # the main job: `generate` with its defaults
            return cmd_generate(parser.parse_args(["generate"]), main_job=True)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        return cmd_info(args)
    except (InputError, BackendUnavailable) as exc:
        _eprint(f"megakernel: error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""What staging a matvec's input in bf16 costs in accuracy, measured on the CPU through the instruction VM (the
kernel stages bf16 inputs at every batch; up to batch 8 it split float32 into bf16 hi + lo until 2026-12-04).

For each preset (seeded random weights, one random prompt per sequence), the VM decodes greedily with float32
activations (the float32 reference the suite compares the kernel with), then twice more, teacher-forced on the
same tokens: every matvec input rounded to bf16 (`bf16`: one MMA per weight tile, bf16 activations), and split
into bf16 hi + lo, two MMAs per weight tile (`hi+lo`, the kernel's form up to batch 8 until 2026-12-04). Per variant: the largest relative logit error over the
decoded steps (max |d logit| / max |logit|), the largest difference of the reference's top-5 log-probabilities,
and the steps where greedy decoding would differ, each with the reference's top-2 gap there (a difference at a gap
below the suite's bf16 near-tie rule, 0.05, is a tie, not an error).

Usage: python3 tools/activation_precision.py [--presets=tiny-llama,llama-3.2-1b-L2] [--steps=N] [--batch=N]
(no GPU; llama-3.2-1b-L2 is the 1B shape with 2 layers, as the e2e tests use)"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolargs import int_flag, positional  # noqa: E402

USAGE = "activation_precision.py [--presets=A,B] [--steps=N] [--batch=N]"


def layers_preset(name: str):
    """A preset, or 'PRESET-L<n>': the preset's shape with n layers."""
    import dataclasses

    from megakernel.model.presets import get_preset
    base, _, n = name.rpartition("-L")
    if base and n.isdigit():
        return dataclasses.replace(get_preset(base), num_layers=int(n))
    return get_preset(name)


def run(name: str, steps: int, batch: int, seed: int = 0) -> dict:
    import torch

    from megakernel.instructions import matvec_stages
    from megakernel.model.kv_cache import contiguous_block_table
    from megakernel.model.weights import random_weights
    from megakernel.schedule.vm import VMDecoder
    from megakernel.testing.tolerances import greedy_tolerance_for

    config = layers_preset(name)
    weights = random_weights(config, seed=seed, dtype=torch.bfloat16)
    prompt_len = 8
    max_seq = prompt_len + steps + 16
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=gen)
    exact = matvec_stages.matvec

    def bf16(w, x):
        return exact(w, x.to(torch.bfloat16).float())

    def hi_lo(w, x):
        hi = x.to(torch.bfloat16).float()
        return exact(w, hi) + exact(w, (x - hi).to(torch.bfloat16).float())

    def decode(matvec, forced=None):
        """Logits of every decoded step; the tokens fed are the prompt, then `forced` or the greedy choice."""
        matvec_stages.matvec = matvec
        try:
            vm = VMDecoder(weights, batch, max_seq)
            table = contiguous_block_table(batch, vm.layout.max_seq_len, vm.layout.block_size)
            logits, tokens = [], []
            cur = prompts[:, 0]
            for pos in range(prompt_len + steps - 1):
                _, lg = vm.step(cur, torch.full((batch,), pos), table)
                if pos + 1 < prompt_len:
                    cur = prompts[:, pos + 1]
                    continue
                logits.append(lg)
                cur = lg.argmax(-1) if forced is None else forced[len(tokens)]
                tokens.append(cur)
            return torch.stack(logits), torch.stack(tokens)
        finally:
            matvec_stages.matvec = exact

    ref_logits, ref_tokens = decode(exact)
    gap_rule = greedy_tolerance_for(torch.bfloat16).near_tie_gap
    ref_lp = torch.log_softmax(ref_logits, -1)
    top5 = ref_lp.topk(5, -1).indices
    out = {"preset": name, "steps": ref_logits.shape[0], "batch": batch}
    for label, mv in (("bf16", bf16), ("hi+lo", hi_lo)):
        lg, _ = decode(mv, forced=ref_tokens)
        lp = torch.log_softmax(lg, -1)
        rel = ((lg - ref_logits).abs().amax() / ref_logits.abs().amax()).item()
        dlp = (lp.gather(-1, top5) - ref_lp.gather(-1, top5)).abs().amax().item()
        differ = (lg.argmax(-1) != ref_logits.argmax(-1)).nonzero().tolist()
        top2 = ref_lp.topk(2, -1).values
        gaps = [(top2[s, b, 0] - top2[s, b, 1]).item() for s, b in differ]
        out[label] = {"max_rel_logit_err": rel, "max_top5_logprob_diff": dlp, "greedy_differs_at": len(differ),
                      "of_which_ties": sum(g < gap_rule for g in gaps), "gaps": [round(g, 4) for g in gaps[:8]]}
    return out


def main() -> None:
    positional(__doc__, USAGE, 0, flags=("--presets", "--steps", "--batch"))
    presets = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--presets=")), "tiny-llama,tiny-qwen3")
    steps, batch = int_flag("--steps", 32, USAGE), int_flag("--batch", 2, USAGE)
    for name in presets.split(","):
        try:
            layers_preset(name)
        except (KeyError, ValueError) as e:
            sys.exit(f"usage: {USAGE}  (unknown preset {name!r}: {e})")
    for name in presets.split(","):
        r = run(name, steps, batch)
        for label in ("bf16", "hi+lo"):
            v = r[label]
            print(f"{name} batch {batch}, {r['steps']} steps, {label:6s}: max rel logit err "
                  f"{v['max_rel_logit_err']:.2e}, max top-5 logprob diff {v['max_top5_logprob_diff']:.2e}, greedy "
                  f"differs at {v['greedy_differs_at']} (steps x sequences; {v['of_which_ties']} at a near tie; "
                  f"gaps {v['gaps']})", flush=True)


if __name__ == "__main__":
    main()

"""Rejection sampling of one vLLM step whose requests drafted different counts: specdec's
sampler (sampler.py: one walk per draft count over vLLM's logits rows) against its padded
layout (every request's rows copied into [B, K + 1, V] first, the path such steps took
before) and vLLM's own CPU rejection sampler, on the same greedy inputs (point-mass drafts,
the vocabulary of SmolLM2, V = 49152; float32 logits, as vLLM's RejectionSampler hands them
over whatever the model's dtype). The three agree token for token (checked); median of
--iters calls, alternated call by call.

Steps: 32 requests, half with 6 drafts and half without (arrivals beside speculating
requests); 32 requests with 2-8 drafts (trees of several sizes); 8 requests with 8 drafts
and one arrival.

    python benchmarks/bench_vllm_sampler.py --threads 2 \
        --json benchmarks/results/<date>_<machine>_vllm-sampler.json
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

from specdec.bench.vllm import sampling_metadata  # noqa: E402
from specdec.integrations.vllm import sampler  # noqa: E402

V = 49152
STEPS = {
    "32: 16 with 6 drafts, 16 without": [6, 0] * 16,
    "32: 2-8 drafts": [2 + (i * 5) % 7 for i in range(32)],
    "8: 7 with 8 drafts, 1 without": [8] * 7 + [0],
}


def step_inputs(counts: list, gen: torch.Generator) -> tuple:
    """vLLM's rejection_sample arguments for a step with these draft counts: each draft the
    target's argmax with probability 0.7 (a few accepted per request)."""
    n, B = sum(counts), len(counts)
    logits = torch.randn(n, V, generator=gen) * 2
    best = logits.argmax(-1)
    guess = torch.randint(V, (n,), generator=gen)
    drafts = torch.where(torch.rand(n, generator=gen) < 0.7, best, guess).to(torch.int32)
    cu = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    bonus = torch.randint(V, (B, 1), generator=gen)
    return drafts, list(counts), max(counts), cu, None, logits, bonus


def padded_layout(drafts, counts, K, cu, draft_probs, logits, bonus, metadata):
    """The padded path: chain_batch's [B, K + 1, V] copy, then one walk (greedy)."""
    B = len(counts)
    tree = sampler.chain_batch(drafts, counts, K, draft_probs, logits, bonus)
    greedy = (torch.zeros(B), torch.zeros(B, dtype=torch.int32), torch.ones(B))
    return tree.walk(*greedy, torch.zeros(B, K + 2))[2]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # vLLM's CPU kernels, as in a worker
    sides = {
        "specdec per draft count": sampler.rejection_sample,
        "specdec padded copy": padded_layout,
        "vLLM": rejection_sampler.rejection_sample,
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    for step, counts in STEPS.items():
        inputs = step_inputs(counts, gen)
        metadata = sampling_metadata(len(counts))
        outputs = [f(*inputs, metadata) for f in sides.values()]
        same = all(torch.equal(outputs[0].to(torch.int32), o.to(torch.int32)) for o in outputs)
        times = {name: [] for name in sides}
        for _ in range(args.iters):
            for name, f in sides.items():
                t0 = time.perf_counter()
                f(*inputs, metadata)
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t[3:]) * 1e3 for name, t in times.items()}
        rows.append({"step": step, "ms": ms, "same_tokens": same})
        print(
            f"{step:34s} "
            + "  ".join(f"{name} {t:6.2f} ms" for name, t in ms.items())
            + f"  same={same}",
            flush=True,
        )
        if args.json:
            write_json(args.json, rows, {"threads": args.threads, "iters": args.iters})


if __name__ == "__main__":
    main()

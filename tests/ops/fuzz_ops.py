"""Seeded fuzzing of the op checks and kernels: random valid and invalid inputs, every backend.

Run as a script (tests/ops/test_op_fuzz.py starts it in a subprocess, so that a crash or a hang is
a failed test and not a dead test run):

    python tests/ops/fuzz_ops.py --op tree_verify --backends cpp,triton --cases 40 --seed 0

Each case draws a random problem of the op. Valid problems must equal the reference (float64
for tree_verify, exact for the integer ops and for tree_rejection_sample given the same
uniforms). Invalid problems get one random corruption (a value out of range, a wide int64
value, a wrong shape or dtype, a zero-sized dimension) and must raise RuntimeError whose
message names the corrupted argument. One line per case goes to stdout (flushed before the
op runs, so the last line names the case that crashed or hung); the exit code is the number of
failed cases, capped at 100.
"""

import argparse
import math
import random
import sys
import traceback

import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import TREE_KINDS, kv_layout, random_root_paths, random_trees

WIDE = 2**32  # an int64 value that wraps to a small int32 value when narrowed


def rand_trees(rng, B, T):
    """parents int64 [B, T], num_nodes int64 [B]: trees of a random testing.TREE_KINDS shape."""
    parents, num_nodes = random_trees(B, T, rng.choice(TREE_KINDS), torch_gen(rng))
    return parents.long(), num_nodes.long()


def torch_gen(rng):
    """A torch.Generator seeded from the case's rng, so every case is reproducible alone."""
    return torch.Generator().manual_seed(rng.randrange(2**31))


def index_dtype(rng):
    return rng.choice([torch.int32, torch.int64])


# ---------------------------------------------------------------- problems
def caches(rng, lead, num_blocks, block_size, Hkv, D, dtype):
    """k_cache, v_cache in a random engine layout (views with any strides, docs/ops.md)."""
    names = ["contiguous", "vllm_flash", "flashinfer_nhd", "flashinfer_hnd"]
    if block_size == 1:
        names.append("sglang_pool")
    tensors, views = kv_layout(rng.choice(names), lead, num_blocks, block_size, Hkv, D, dtype)
    return views(tensors)


def problem_build_tree_mask(rng):
    B, T = rng.randint(1, 3), rng.randint(1, 70)
    parents, num_nodes = rand_trees(rng, B, T)
    dt = index_dtype(rng)
    return {"parents": parents.to(dt), "num_nodes": num_nodes.to(dt)}


def problem_tree_verify(rng):
    B, T = rng.randint(1, 3), rng.randint(1, 9)
    Hkv = rng.choice([1, 2])
    Hq, D = Hkv * rng.choice([1, 2, 3]), rng.choice([4, 8, 16])
    block_size, max_blocks = rng.choice([1, 2, 4, 16]), rng.randint(1, 6)
    capacity = block_size * max_blocks
    while capacity < T:
        max_blocks += 1
        capacity += block_size
    num_blocks = B * max_blocks + rng.randint(0, 3)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    parents, num_nodes = rand_trees(rng, B, T)
    tree_mask, _ = reference.build_tree_mask(parents.to(torch.int32), num_nodes.to(torch.int32))
    cache_lens = torch.tensor([rng.randint(0, capacity - int(n)) for n in num_nodes])
    dt = index_dtype(rng)
    k_cache, v_cache = caches(rng, (), num_blocks, block_size, Hkv, D, dtype)
    q = torch.randn(B, T, Hq + rng.choice([0, 2 * Hkv]), D).to(dtype)[:, :, :Hq]  # a QKV slice?
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": torch.randperm(num_blocks)[: B * max_blocks].view(B, max_blocks).to(dt),
        "cache_lens": cache_lens.to(dt),
        "num_nodes": num_nodes.to(dt),
        "tree_mask": tree_mask,
        "sm_scale": rng.choice([D**-0.5, 1.0, -0.3, 0.0, 100.0]),
    }


def problem_tree_rejection_sample(rng):
    B, T, V = rng.randint(1, 3), rng.randint(1, 8), rng.randint(2, 40)
    parents, num_nodes = rand_trees(rng, B, T)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    probs = None
    if rng.random() < 0.4:
        probs = torch.softmax(torch.randn(B, T, V), -1)
    dt = index_dtype(rng)
    return {
        "target_logits": (3 * torch.randn(B, T, V)).to(dtype),
        "draft_tokens": torch.randint(0, V, (B, T)).to(dt),
        "parents": parents.to(dt),
        "num_nodes": num_nodes.to(dt),
        "draft_probs": probs,
        "temperature": torch.tensor([rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(B)]),
        "top_k": torch.tensor([rng.choice([0, 1, 3, V, V + 5]) for _ in range(B)]).to(dt),
        "top_p": torch.tensor([rng.choice([1.0, 0.9, 0.5, 0.01]) for _ in range(B)]),
        "uniforms": torch.rand(B, T + 1),
    }


def problem_compact_kv(rng):
    B, T = rng.randint(1, 3), rng.randint(1, 8)
    block_size, max_blocks = rng.choice([1, 2, 4, 16]), rng.randint(1, 5)
    while block_size * max_blocks < T:
        max_blocks += 1
    num_blocks = B * max_blocks + rng.randint(0, 2)
    layers = rng.choice([None, 1, 3])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    lead = () if layers is None else (layers,)
    k_cache, v_cache = caches(rng, lead, num_blocks, block_size, 2, 4, dtype)
    accepted, num_accepted = random_root_paths(B, T, torch_gen(rng))
    capacity = block_size * max_blocks
    dt = index_dtype(rng)
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": torch.randperm(num_blocks)[: B * max_blocks].view(B, max_blocks).to(dt),
        "cache_lens": torch.tensor([rng.randint(0, capacity - T) for _ in range(B)]).to(dt),
        "accepted_nodes": accepted.to(dt),
        "num_accepted": num_accepted.to(dt),
    }


PROBLEMS = {
    "build_tree_mask": problem_build_tree_mask,
    "tree_verify": problem_tree_verify,
    "tree_rejection_sample": problem_tree_rejection_sample,
    "compact_kv": problem_compact_kv,
}


# ---------------------------------------------------------------- corruptions
def _set(name, value, where=None):
    """Corruption: entry `where` (random valid index by default) of p[name] := value."""

    def apply(p, rng):
        t = p[name]
        if t.dtype == torch.int32 and abs(value) > 2**31 - 1:
            p[name] = t = t.to(torch.int64)  # a wide value needs an int64 tensor
        idx = where(p, rng) if where else tuple(rng.randrange(s) for s in t.shape)
        t[idx] = value
        return name

    return apply


def _first_block(p, rng):
    """Column 0 of a random block table row: a block every request uses."""
    return (rng.randrange(p["block_table"].shape[0]), 0)


def _node(p, rng, key="num_nodes"):
    """A (b, i) index of a valid non-root node of the tree, or None."""
    n = p[key] if key in p else None
    b = rng.randrange(n.shape[0])
    if int(n[b]) < 2:
        return None
    return (b, rng.randint(1, int(n[b]) - 1))


def _replace(name, fn):
    def apply(p, rng):
        p[name] = fn(p[name], p, rng)
        return name

    return apply


def _caches(fn):
    """The same reshaping of k_cache and v_cache (e.g. block_size 0), reported as k_cache."""

    def apply(p, rng):
        p["k_cache"], p["v_cache"] = fn(p["k_cache"]), fn(p["v_cache"])
        return "k_cache"

    return apply


def _node_value(name, make):
    """Sets a non-root node entry of p[name] (so the walk / check reads it) to make(i, p)."""

    def apply(p, rng):
        idx = _node(p, rng)
        if idx is None:
            return None
        t = p[name]
        value = make(idx[1], p, rng)
        if t.dtype == torch.int32 and abs(value) > 2**31 - 1:
            p[name] = t = t.to(torch.int64)
        t[idx] = value
        return name

    return apply


def _another_layout(cache):
    """cache [num_blocks, block_size, Hkv, D] with two of its dimensions swapped, two of
    different sizes (a transpose of equal ones is the same shape, only strided, which the
    ops accept); a cache of four equal dimensions loses one of its D entries instead."""
    for i, j in ((0, 1), (1, 2), (2, 3), (0, 2), (0, 3), (1, 3)):
        if cache.shape[i] != cache.shape[j]:
            return cache.transpose(i, j)
    return cache[..., :-1]


TREE_CORRUPTIONS = [
    _node_value("parents", lambda i, p, rng: rng.choice([i, i + 1, -1, -5])),
    _node_value("parents", lambda i, p, rng: WIDE + rng.randrange(i)),  # would wrap to valid
    _set("parents", 3, where=lambda p, rng: (rng.randrange(p["parents"].shape[0]), 0)),
    _set("num_nodes", 0),
    _replace("num_nodes", lambda t, p, rng: t + p["parents"].shape[1]),
    _replace("num_nodes", lambda t, p, rng: t.to(torch.int64) + WIDE),  # would wrap to valid
    _replace("parents", lambda t, p, rng: t.float()),
    _replace("num_nodes", lambda t, p, rng: t[:-1] if t.shape[0] > 1 else t.view(1, -1)),
]

CORRUPTIONS = {
    "build_tree_mask": TREE_CORRUPTIONS,
    "tree_verify": [
        _replace("cache_lens", lambda t, p, rng: t - t.max() - 1),
        _replace(
            "cache_lens", lambda t, p, rng: t + p["block_table"].shape[1] * p["k_cache"].shape[1]
        ),
        _replace("cache_lens", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _set("block_table", 10**6, where=_first_block),
        _set("block_table", -1, where=_first_block),
        _replace("block_table", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _set("num_nodes", 0),
        _replace("num_nodes", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _replace("sm_scale", lambda s, p, rng: rng.choice([1e39, 1e300, math.inf, math.nan])),
        _replace("tree_mask", lambda t, p, rng: t[:, :, :0]),
        _replace("tree_mask", lambda t, p, rng: t.int()),
        _caches(lambda t: t[:, :0].contiguous()),  # block_size 0
        _caches(lambda t: t[:0].contiguous()),  # num_blocks 0
        _replace("v_cache", lambda t, p, rng: t.double()),
        _replace("q", lambda t, p, rng: t[..., :-1]),
        _replace("q", lambda t, p, rng: t.int()),
        _replace("k_cache", lambda t, p, rng: _another_layout(t)),
        _replace("block_table", lambda t, p, rng: t.float()),
        _replace("cache_lens", lambda t, p, rng: t[:0]),
    ],
    "tree_rejection_sample": TREE_CORRUPTIONS
    + [
        _node_value(
            "draft_tokens",
            lambda i, p, rng: rng.choice([-1, p["target_logits"].shape[2], WIDE + 1]),
        ),
        _set("temperature", -0.5),
        _set("temperature", math.nan),
        _set("top_p", 0.0),
        _set("top_p", 1.5),
        _set("top_k", -1),
        _set("top_k", WIDE + 1),
        _set("uniforms", 1.0),
        _set("uniforms", -0.1),
        _set("uniforms", math.nan),
        _set(
            "target_logits",
            math.nan,
            where=lambda p, rng: (
                rng.randrange(p["target_logits"].shape[0]),
                0,
                rng.randrange(p["target_logits"].shape[2]),
            ),
        ),
        _replace("uniforms", lambda t, p, rng: t[:, :-1]),
        _replace(
            "draft_probs", lambda t, p, rng: torch.rand_like(p["target_logits"][..., :-1].float())
        ),
        _replace("target_logits", lambda t, p, rng: t.int()),
        _replace("top_k", lambda t, p, rng: t.float()),
        _replace("temperature", lambda t, p, rng: t[:0]),
    ],
    "compact_kv": [
        _set(
            "accepted_nodes",
            1,
            where=lambda p, rng: (rng.randrange(p["accepted_nodes"].shape[0]), 0),
        ),
        _replace("num_accepted", lambda t, p, rng: t * 0 + p["accepted_nodes"].shape[1]),
        _replace("num_accepted", lambda t, p, rng: t * 0 - 1),
        _replace("num_accepted", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _replace("cache_lens", lambda t, p, rng: t - t.max() - 1),
        _replace("cache_lens", lambda t, p, rng: t.to(torch.int64) + 2**31 - 1),
        _replace("cache_lens", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _set("block_table", 10**6, where=_first_block),
        _replace("block_table", lambda t, p, rng: t.to(torch.int64) + WIDE),
        _caches(lambda t: t[..., :0, :, :].contiguous()),  # block_size 0
        _caches(lambda t: t[..., :0, :, :, :].contiguous()),  # num_blocks 0
        _replace("v_cache", lambda t, p, rng: t.double()),
        _replace("accepted_nodes", lambda t, p, rng: t.float()),
        _replace("k_cache", lambda t, p, rng: t.unsqueeze(0).unsqueeze(0)),
    ],
}

# Words a message may use for the argument it names (the checks name the derived quantity,
# e.g. "cache_lens + num_nodes ... beyond the positions its block_table row owns").
ALIASES = {
    "cache_lens": ("cache_lens",),
    "block_table": ("block_table",),
    "k_cache": ("k_cache", "v_cache", "block_size", "num_blocks"),
    "v_cache": ("v_cache", "k_cache"),
    "tree_mask": ("tree_mask",),
    "num_nodes": ("num_nodes", "parents"),
    "parents": ("parents",),
    "num_accepted": ("num_accepted",),
}


# ---------------------------------------------------------------- running
def _copy_strided(t):
    """A copy with t's strides (clone() makes non-dense views contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


def run(op, p, backend):
    p = dict(p)
    if op == "tree_verify":
        return sk.tree_verify(**p, backend=backend)
    if op == "compact_kv":
        k, v = (_copy_strided(p.pop(n)) for n in ("k_cache", "v_cache"))
        sk.compact_kv(k, v, **p, backend=backend)
        return k, v
    return getattr(sk, op)(**p, backend=backend)


def expected(op, p):
    """The float64 / exact reference result of a valid problem."""
    if op == "tree_verify":
        q = {k: (v.double() if k in ("q", "k_cache", "v_cache") else v) for k, v in p.items()}
        return reference.tree_verify(**q)
    return run(op, p, "reference")


def same(op, got, want, p):
    if op == "tree_verify":
        tol = 1e-4 if p["q"].dtype == torch.float32 else 3e-2
        return torch.allclose(got.double(), want, rtol=tol, atol=tol)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return all(torch.equal(g, w.to(g.dtype)) for g, w in zip(got, want))


def fuzz(op, backends, cases, seed):
    failures = 0
    for case in range(cases):
        rng = random.Random(f"{op}:{seed}:{case}")
        torch.manual_seed(rng.randrange(2**31))
        p = PROBLEMS[op](rng)
        bad = None
        if case % 3 != 0:  # two thirds of the cases are corrupted
            bad = rng.choice(CORRUPTIONS[op])(p, rng)
        kind = f"invalid {bad}" if bad else "valid"
        for backend in backends:
            print(f"case {case} ({kind}) {backend}", flush=True)
            try:
                got = run(op, p, backend)
            except RuntimeError as e:
                names = ALIASES.get(bad, (bad,)) if bad else ()
                if not bad or not any(n in str(e) for n in names):
                    failures += 1
                    print(f"FAIL case {case} {backend}: unexpected error for {kind}: {e}")
                continue
            except Exception:  # any other type is a failure: the contract is RuntimeError
                failures += 1
                print(f"FAIL case {case} {backend}: {traceback.format_exc()}")
                continue
            if bad:
                failures += 1
                print(f"FAIL case {case} {backend}: {kind} input did not raise")
            elif not same(op, got, expected(op, p), p):
                failures += 1
                print(f"FAIL case {case} {backend}: result differs from the reference")
    print(f"done {op}: {cases} cases, {failures} failures", flush=True)
    return failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(PROBLEMS), required=True)
    parser.add_argument("--backends", default="cpp")
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return min(100, fuzz(args.op, args.backends.split(","), args.cases, args.seed))


if __name__ == "__main__":
    sys.exit(main())

"""One verify step of the CUDA C++ kernels captured in a CUDA graph and replayed.

build_tree_mask -> tree_verify -> tree_rejection_sample -> compact_kv are captured once on
static buffers; each replay gets fresh inputs (other trees, cache lengths, logits, caches)
copied into those buffers and must reproduce an eager run of the same ops bitwise (the
kernels are deterministic and choose their launch shapes from tensor shapes only, never
from values, which is what makes them capturable). The attention output is also checked
against the reference, so that two equally wrong runs cannot pass.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import random_block_table, random_trees

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CUDA graphs exist only on CUDA devices)",
)

B, T, HQ, HKV, D, BLOCK, BLOCKS_PER_SEQ, LAYERS, V = 3, 8, 4, 2, 64, 16, 6, 2, 1000
NUM_BLOCKS = B * BLOCKS_PER_SEQ + 2
DTYPE = torch.float16
ATOL = RTOL = 2e-3  # float16 output of an fp32-accumulated attention vs the float64 reference


def random_step():
    """Fresh inputs of one step: {name: CPU tensor}, shapes fixed, values new each call.

    Request 0 is greedy with a full tree whose every draft token is the argmax of its
    parent's logits, so its walk always accepts nodes and compact_kv has work to do.
    """
    parents, num_nodes = random_trees(B, T, "random")
    num_nodes[0] = T
    parents[0] = random_trees(1, T, "random", full=True)[0][0]
    logits = 4 * torch.randn(B, T, V)  # peaked, so sampled walks also go deep at times
    draft_tokens = torch.randint(0, V, (B, T), dtype=torch.int32)
    draft_tokens[0, 1:] = logits[0].argmax(-1)[parents[0, 1:].long()].int()
    return {
        "parents": parents,
        "num_nodes": num_nodes,
        "cache_lens": torch.randint(0, BLOCKS_PER_SEQ * BLOCK - T + 1, (B,), dtype=torch.int32),
        "block_table": random_block_table(B, BLOCKS_PER_SEQ, NUM_BLOCKS),
        "q": torch.randn(B, T, HQ, D, dtype=DTYPE),
        "k_cache": torch.randn(LAYERS, NUM_BLOCKS, BLOCK, HKV, D, dtype=DTYPE),
        "v_cache": torch.randn(LAYERS, NUM_BLOCKS, BLOCK, HKV, D, dtype=DTYPE),
        "logits": logits,
        "draft_tokens": draft_tokens,
        "temperature": torch.tensor([0.0, 0.7, 1.0]),
        "top_k": torch.tensor([0, 50, 0], dtype=torch.int32),
        "top_p": torch.tensor([1.0, 0.9, 0.8]),
        "uniforms": torch.rand(B, T + 1),
    }


def verify_step(x):
    """The captured step; mutates x["k_cache"], x["v_cache"]. Returns its outputs."""
    tree_mask, depth = sk.build_tree_mask(x["parents"], x["num_nodes"], backend="cpp")
    attn = sk.tree_verify(
        x["q"],
        x["k_cache"][0],
        x["v_cache"][0],
        x["block_table"],
        x["cache_lens"],
        x["num_nodes"],
        tree_mask,
        backend="cpp",
    )
    accepted, num_accepted, tokens = sk.tree_rejection_sample(
        x["logits"],
        x["draft_tokens"],
        x["parents"],
        x["num_nodes"],
        None,
        x["temperature"],
        x["top_k"],
        x["top_p"],
        x["uniforms"],
        backend="cpp",
    )
    sk.compact_kv(
        x["k_cache"],
        x["v_cache"],
        x["block_table"],
        x["cache_lens"],
        accepted,
        num_accepted,
        backend="cpp",
    )
    return {
        "tree_mask": tree_mask,
        "depth": depth,
        "attn": attn,
        "accepted": accepted,
        "num_accepted": num_accepted,
        "tokens": tokens,
    }


def reference_step(x):
    """verify_step by the references on CPU (float64 attention and sampling); mutates x's caches."""
    tree_mask, depth = reference.build_tree_mask(x["parents"], x["num_nodes"])

    def f64(t):
        return t.double()

    attn = reference.tree_verify(
        f64(x["q"]),
        f64(x["k_cache"][0]),
        f64(x["v_cache"][0]),
        x["block_table"],
        x["cache_lens"],
        x["num_nodes"],
        tree_mask,
        D**-0.5,
    )
    accepted, num_accepted, tokens = reference.tree_rejection_sample(
        f64(x["logits"]),
        x["draft_tokens"],
        x["parents"],
        x["num_nodes"],
        None,
        x["temperature"],
        x["top_k"],
        x["top_p"],
        x["uniforms"],
    )
    reference.compact_kv(
        x["k_cache"], x["v_cache"], x["block_table"], x["cache_lens"], accepted, num_accepted
    )
    return {
        "tree_mask": tree_mask,
        "depth": depth,
        "attn": attn,
        "accepted": accepted,
        "num_accepted": num_accepted,
        "tokens": tokens,
    }


def poison(outputs):
    """Every output element must be rewritten by a replay."""
    for t in outputs.values():
        t.fill_(float("nan") if t.is_floating_point() else -7)


def test_verify_step_replays_like_eager():
    if sk.validate_enabled():
        pytest.skip("SPECDEC_VALIDATE=1 reads index values on the host, which capture forbids")

    def cuda(x):
        return {name: t.cuda() for name, t in x.items()}

    static = cuda(random_step())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch requires
        verify_step({name: t.clone() for name, t in static.items()})
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = verify_step(static)

    accepted_total = 0
    for _ in range(3):
        fresh = random_step()
        for name, t in fresh.items():
            static[name].copy_(t)
        poison(graph_out)
        graph.replay()
        eager_in = cuda(fresh)
        eager_out = verify_step(eager_in)
        ref_in = {name: t.clone() for name, t in fresh.items()}
        ref_out = reference_step(ref_in)
        torch.cuda.synchronize()

        for name, want in eager_out.items():
            assert torch.equal(graph_out[name], want), f"replayed {name} differs from eager"
        for cache in ("k_cache", "v_cache"):
            assert torch.equal(static[cache], eager_in[cache]), (
                f"replayed {cache} differs from eager"
            )
            assert torch.equal(static[cache].cpu(), ref_in[cache]), (
                f"{cache} differs from the reference"
            )
        torch.testing.assert_close(
            graph_out["attn"].cpu().double(), ref_out["attn"], atol=ATOL, rtol=RTOL
        )
        for name in ("tree_mask", "depth", "accepted", "num_accepted", "tokens"):
            assert torch.equal(graph_out[name].cpu(), ref_out[name]), (
                f"{name} differs from the reference"
            )
        accepted_total += int(ref_out["num_accepted"].sum())
    assert accepted_total >= 3, "request 0's greedy drafts should be accepted at every step"

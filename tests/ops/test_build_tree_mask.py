"""build_tree_mask (cpp and triton backends) against the reference."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.testing import TREE_KINDS, random_trees
from specdec_kernels.testing import value_checks_run as _value_checks_run


def _poison_padding(parents, num_nodes):
    """Garbage (even invalid) parents past num_nodes: the op must never read them."""
    parents = parents.clone()
    T = parents.shape[1]
    for b in range(parents.shape[0]):
        n = int(num_nodes[b])
        parents[b, n:] = torch.randint(-5, 2 * T + 5, (T - n,), dtype=parents.dtype)
    return parents


@pytest.mark.parametrize("T", [1, 5, 64, 65, 130])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_matches_reference(kind, T, device, backend):
    parents, num_nodes = random_trees(4, T, kind)
    parents = _poison_padding(parents, num_nodes)
    want_mask, want_depth = reference.build_tree_mask(parents, num_nodes)
    mask, depth = sk.build_tree_mask(parents.to(device), num_nodes.to(device), backend=backend)
    assert mask.dtype == torch.int64 and mask.shape == (4, T, (T + 63) // 64)
    assert depth.dtype == torch.int32 and depth.shape == (4, T)
    assert torch.equal(mask.cpu(), want_mask)
    assert torch.equal(depth.cpu(), want_depth)


def test_full_trees_and_int64_inputs(device, backend):
    """Every node valid (no padding rows), int64 index tensors."""
    parents, num_nodes = random_trees(3, 70, "random", full=True)
    want_mask, want_depth = reference.build_tree_mask(parents, num_nodes)
    mask, depth = sk.build_tree_mask(
        parents.long().to(device), num_nodes.long().to(device), backend=backend
    )
    assert torch.equal(mask.cpu(), want_mask)
    assert torch.equal(depth.cpu(), want_depth)


def test_chain_words(device, backend):
    """Known answer across the word boundary: bit 63 is the sign bit of the packed int64."""
    parents, num_nodes = random_trees(1, 65, "chain", full=True)
    mask, depth = sk.build_tree_mask(parents.to(device), num_nodes.to(device), backend=backend)
    assert mask[0, 62].tolist() == [2**63 - 1, 0]
    assert mask[0, 63].tolist() == [-1, 0]
    assert mask[0, 64].tolist() == [-1, 1]
    assert depth[0].tolist() == list(range(65))


@pytest.mark.parametrize(
    "case, match",
    [
        ("not_topological", r"parents\[1, 3\] = 3 must satisfy 0 <= parent < 3"),
        ("forward_parent", r"parents\[1, 3\] = 5 must satisfy"),
        ("root_has_parent", r"parents\[0, 0\] must be -1"),
        ("zero_nodes", r"num_nodes\[1\] = 0 is out of range"),
        ("too_many_nodes", r"num_nodes\[1\] = 7 is out of range"),
    ],
)
def test_bad_values(case, match, device, backend):
    if not _value_checks_run(device):
        pytest.skip("value checks on CUDA tensors run only with SPECDEC_VALIDATE=1 (documented)")
    parents, num_nodes = random_trees(2, 6, "chain", full=True)
    if case == "not_topological":
        parents[1, 3] = 3
    elif case == "forward_parent":
        parents[1, 3] = 5
    elif case == "root_has_parent":
        parents[0, 0] = 0
    elif case == "zero_nodes":
        num_nodes[1] = 0
    else:
        num_nodes[1] = 7
    with pytest.raises(RuntimeError, match=match):
        sk.build_tree_mask(parents.to(device), num_nodes.to(device), backend=backend)


@pytest.mark.parametrize(
    "case, match",
    [
        ("float_parents", r"parents must be an int32 or int64 tensor"),
        ("float_num_nodes", r"num_nodes must be an int32 or int64 tensor"),
        ("parents_rank", r"parents must have 2 dimensions"),
        ("num_nodes_rank", r"num_nodes must have 1 dimensions"),
        ("batch_mismatch", r"num_nodes.size\(0\) must equal the batch size B of parents"),
        ("empty_tree", r"parents must have at least one node"),
    ],
)
def test_bad_shapes_and_dtypes(case, match, device, backend):
    parents, num_nodes = random_trees(2, 6, "random", full=True)
    if case == "float_parents":
        parents = parents.float()
    elif case == "float_num_nodes":
        num_nodes = num_nodes.float()
    elif case == "parents_rank":
        parents = parents[0]
    elif case == "num_nodes_rank":
        num_nodes = num_nodes[:, None]
    elif case == "batch_mismatch":
        num_nodes = torch.cat([num_nodes, num_nodes[:1]])
    else:
        parents = parents[:, :0]
    with pytest.raises(RuntimeError, match=match):
        sk.build_tree_mask(parents.to(device), num_nodes.to(device), backend=backend)


def test_opcheck(device):
    parents, num_nodes = random_trees(3, 70, "random")
    torch.library.opcheck(
        torch.ops.specdec.build_tree_mask, (parents.to(device), num_nodes.to(device))
    )

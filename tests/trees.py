"""Random draft trees and paged caches for the op tests."""
import torch

TREE_KINDS = ("chain", "star", "deep", "bushy", "random", "single")


def random_parents(T, n, kind, gen=None):
    """parents int32 [T] of a tree with n valid nodes (padding -1), of the given shape."""
    p = torch.full((T,), -1, dtype=torch.int32)
    for i in range(1, n):
        if kind == "chain":
            p[i] = i - 1
        elif kind == "star":
            p[i] = 0
        elif kind == "deep":  # mostly a chain with a few side branches
            p[i] = i - 1 if torch.rand(1, generator=gen) < 0.8 else int(torch.randint(0, i, (1,), generator=gen))
        elif kind == "bushy":  # wide and shallow: parents among the first few nodes
            p[i] = int(torch.randint(0, max(1, min(i, 1 + i // 4)), (1,), generator=gen))
        else:
            p[i] = int(torch.randint(0, i, (1,), generator=gen))
    return p


def random_trees(B, T, kind="random", gen=None, full=False):
    """parents int32 [B, T], num_nodes int32 [B]; kind "single" gives one-node trees."""
    if kind == "single":
        n = torch.ones(B, dtype=torch.int32)
    elif full:
        n = torch.full((B,), T, dtype=torch.int32)
    else:
        n = torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32)
    parents = torch.stack([random_parents(T, int(n[b]), kind if kind != "single" else "chain", gen)
                           for b in range(B)])
    return parents, n


def random_block_table(B, blocks_per_seq, num_blocks, gen=None):
    """int32 [B, blocks_per_seq]: a random permutation of physical blocks, disjoint across requests."""
    assert num_blocks >= B * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)[: B * blocks_per_seq]
    return perm.view(B, blocks_per_seq).to(torch.int32)

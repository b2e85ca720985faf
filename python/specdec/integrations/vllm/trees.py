"""Tree speculation inside vLLM's step (docs/integration.md, "Trees inside vLLM").

vLLM 0.32 schedules `num_speculative_tokens + 1` tokens per speculating request, computes
logits at each, and advances a request by its accepted tokens. A tree of K drafted nodes fits
that step when its nodes travel as the request's K "draft tokens" in topological order
(parents before children, so any prefix vLLM keeps is still a tree) and four things change,
all in the worker, hooked by install() on engines whose config asks for trees:

1. Drafting: `NgramTreeProposer` (a custom_class proposer) returns each request's tree as its
   node tokens and keeps the parents; the runner files them under the request's id.
2. Positions and attention: node i of a request sits at cache row `cache_len + i` (vLLM's slot
   mapping, unchanged) but at RoPE position `cache_len + depth(i)`; the attention backend
   (attention.py) verifies with the tree mask built from the registered parents.
3. Sampling: sampler.py's rejection sampling takes the registered parents instead of chains
   (`tree_rejection_sample`, the last node K holding vLLM's bonus token, which vLLM sampled
   from node K's logits), and returns the accepted root path as the request's new tokens.
4. Commit: `compact_kv` moves the accepted nodes' K/V to rows `cache_len + 1 ...` in every
   layer before vLLM advances `num_computed_tokens` by the accepted count (+1), which frees
   the rejected rows.

Exact: greedy output equals vLLM plain token for token (float32,
tests/integrations/test_vllm_trees.py); sampled output follows tree_rejection_sample's rule
(docs/ops.md), whose distribution the op's own tests check (no statistical test inside a
running vLLM engine yet).
"""

import numpy as np
import torch

import specdec_kernels  # noqa: F401  (registers torch.ops.specdec)
from specdec.drafters import NgramDrafter
from specdec.integrations.vllm.options import specdec_options

# One engine step's tree state in this process (a vLLM worker runs one step at a time):
# batch row -> parents of its scheduled nodes (node 0 the root, -1), set when the step's
# inputs are prepared and cleared after its sampling; the block table the attention metadata
# was built with; the cache lengths the step started from; the accepted paths.
_step: dict = {"parents": {}, "block_table": None, "cache_lens": None, "accepted": None}


def step_parents() -> dict:
    """{batch row: parents list} of this step's tree rows ({} outside a tree step)."""
    return _step["parents"]


def write_step_trees(parents: torch.Tensor) -> None:
    """parents [B, T] (chains) <- this step's registered trees, each over its row's first
    nodes (rows past B ignored)."""
    for b, tree in _step["parents"].items():
        if b < parents.shape[0]:
            parents[b, : len(tree)] = torch.as_tensor(tree, dtype=parents.dtype)


def note_block_table(block_table: torch.Tensor) -> None:
    _step["block_table"] = block_table


def trees_enabled(vllm_config) -> bool:
    return bool(specdec_options(vllm_config).get("tree"))


class NgramTreeProposer:
    """specdec's n-gram drafter as a vLLM custom_class proposer that drafts trees: the
    continuations of the longest matching suffix n-gram's recent occurrences merged into a
    trie (NgramDrafter.trie) of at most num_speculative_tokens nodes below the root and
    `tree_branches` first-level branches. propose() returns each row's node tokens (root
    excluded, parents before children); `parents[row]` holds their parents (0 = the root)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        options = specdec_options(vllm_config)
        self.num_nodes = int(spec.num_speculative_tokens)
        self.drafter = NgramDrafter(options.get("ngram_max", 4), options.get("ngram_min", 1))
        # half the nodes deep by default, so that a second continuation finds room
        self.drafter.depth = int(options.get("tree_depth", max(1, self.num_nodes // 2)))
        self.drafter.total = self.num_nodes + 1
        self.drafter.branches = int(options.get("tree_branches", 3))
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.parents: list = []

    def load_model(self, target_model) -> None:
        """No model: drafting reads the request's tokens only."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts, self.parents = [], []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.num_nodes, self.max_model_len - n)
            if not len(sampled) or room <= 0:
                drafts.append([])
                self.parents.append([-1])
                continue
            history = token_ids_cpu[i, :n]
            _, continuations = self.drafter.match(history)
            tokens, parents, _, _ = self.drafter.trie(int(history[-1]), continuations)
            drafts.append([int(t) for t in tokens[1 : room + 1]])
            self.parents.append(list(parents[: room + 1]))
        return drafts


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache [num_blocks, Hkv, block_size, 2 * D] -> (k, v), each the
    logical [num_blocks, block_size, Hkv, D] strided view (no copy)."""
    blocks_first = kv_cache.transpose(1, 2)
    return blocks_first[..., :head_size], blocks_first[..., head_size:]


def tree_positions(parents: list) -> np.ndarray:
    """parents (node 0 the root) -> depth of each node."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def install() -> None:
    """Hooks vLLM's GPUModelRunner (the CPU runner's base) for tree steps; a runner whose
    engine does not ask for trees runs vLLM's code unchanged."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_specdec_trees_hooked", False):
        return
    prepare, sample = GPUModelRunner._prepare_inputs, GPUModelRunner._sample
    propose = GPUModelRunner.propose_draft_token_ids

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = prepare(self, scheduler_output, num_scheduled_tokens)
        if _tree_runner(self):
            _place_tree_nodes(self, scheduler_output, num_scheduled_tokens)
        return result

    def _sample(self, logits, spec_decode_metadata):
        out = sample(self, logits, spec_decode_metadata)
        if _tree_runner(self):
            if spec_decode_metadata is not None:
                _compact(self)
            _step["parents"] = {}  # the step is over: later samplers see no trees
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        if _tree_runner(self):
            self._specdec_parents = dict(zip(self.input_batch.req_ids, self.drafter.parents))
        return drafts

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._sample = _sample
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._specdec_trees_hooked = True


def _tree_runner(runner) -> bool:
    flag = runner.__dict__.get("_specdec_tree")
    if flag is None:
        flag = runner.__dict__["_specdec_tree"] = trees_enabled(runner.vllm_config)
    return flag


def _place_tree_nodes(runner, scheduler_output, num_scheduled_tokens) -> None:
    """Registers this step's tree rows and rewrites their nodes' RoPE positions to
    cache_len + depth (vLLM computed cache_len + i and its slot mapping from it)."""
    registry = runner.__dict__.get("_specdec_parents", {})
    spec = scheduler_output.scheduled_spec_decode_tokens
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = np.concatenate(([0], np.cumsum(num_scheduled_tokens[:num_reqs])))
    computed = batch.num_computed_tokens_cpu[:num_reqs]
    rows: dict = {}
    for b, req_id in enumerate(batch.req_ids[:num_reqs]):
        k = len(spec.get(req_id, ()))
        if k == 0:
            continue
        parents = registry.get(req_id)
        if parents is None or len(parents) < k + 1:
            raise RuntimeError(
                f"specdec trees: request {req_id} has {k} scheduled drafts but no tree of "
                "that size was proposed for it"
            )
        parents = list(parents[: k + 1])
        rows[b] = parents
        depth = tree_positions(parents)
        start = int(starts[b])
        runner.positions[start : start + k + 1] = torch.from_numpy(int(computed[b]) + depth)
    _step["parents"] = rows
    _step["cache_lens"] = torch.from_numpy(computed.astype(np.int32))


def _compact(runner) -> None:
    """compact_kv in every layer: the accepted nodes' K/V to rows cache_len + 1 ..."""
    accepted = _step["accepted"]
    if accepted is None or not _step["parents"]:
        return
    accepted_nodes, num_accepted = accepted
    B = accepted_nodes.shape[0]
    block_table = _step["block_table"][:B]
    cache_lens = _step["cache_lens"][:B]
    for kv_cache in runner.kv_caches:
        k_cache, v_cache = kv_views(kv_cache, kv_cache.shape[-1] // 2)
        torch.ops.specdec.compact_kv(
            k_cache, v_cache, block_table, cache_lens, accepted_nodes, num_accepted
        )
    _step["accepted"] = None


def record_acceptance(accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
    _step["accepted"] = (accepted_nodes, num_accepted)

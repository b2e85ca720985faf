"""Tree speculation inside vLLM's step (docs/integration.md, "Trees inside vLLM").

vLLM 0.32 schedules `num_speculative_tokens + 1` tokens per speculating request, computes
logits at each, and advances a request by its accepted tokens. A tree of K drafted nodes fits
that step when its nodes travel as the request's K "draft tokens" in topological order
(parents before children, so any prefix vLLM keeps is still a tree) and four things change,
all in the worker, hooked by install() on engines whose config asks for trees:

1. Drafting: hosted.DrafterProposer (a custom_class proposer hosting a specdec Drafter) is
   handed the step's hidden states and emitted tokens, then returns each request's tree as its
   node tokens and keeps the parents; the runner files them under the request's id. For the
   EAGLE-3 head the target's forward also returns its feature layers' outputs (vLLM's aux
   hidden states, switched on when the model loads).
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
    setup_aux = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = prepare(self, scheduler_output, num_scheduled_tokens)
        if _tree_runner(self):
            _place_tree_nodes(self, scheduler_output, num_scheduled_tokens)
        return result

    def _sample(self, logits, spec_decode_metadata):
        if (
            _tree_runner(self)
            and spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
        ):
            # no drafts in the step (the adaptive policy went plain, or nothing matched):
            # one logits row per request, sampled as vLLM samples a plain step (its rejection
            # sampler would copy them out and sample the same tokens as bonus tokens)
            spec_decode_metadata = None
        out = sample(self, logits, spec_decode_metadata)
        if _tree_runner(self):
            if spec_decode_metadata is not None:
                _compact(self)
            _step["parents"] = {}  # the step is over: later samplers see no trees
        return out

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        *args,
        **kwargs,
    ):
        if _tree_runner(self):
            _hand_over_step(
                self, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states
            )
        drafts = propose(
            self,
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            *args,
            **kwargs,
        )
        if _tree_runner(self):
            self._specdec_parents = dict(zip(self.input_batch.req_ids, self.drafter.parents))
        return drafts

    def _setup_eagle3_aux_hidden_state_outputs(self):
        layers = _tree_runner(self) and self.drafter.vllm_aux_layers()
        if not layers:
            return setup_aux(self)
        # the hosted drafter reads feature layers (EAGLE-3): the forward returns them
        self.use_aux_hidden_state_outputs = True
        self.model.set_aux_hidden_state_layers(layers)

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._sample = _sample
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
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
        drafts = spec.get(req_id, ())
        k = len(drafts)
        if k == 0:
            continue
        # drafts past the proposed tree (or all of them, when none was proposed: vLLM's
        # placeholder drafts of a request entering decode from its waiting queue, its zero
        # drafts of a step it ran no drafting for) hang below it as a chain: verified like
        # any node (exact), and out-of-range placeholders are never accepted
        parents = list(registry.get(req_id, [-1]))[: k + 1]
        parents += range(len(parents) - 1, k)
        rows[b] = parents
        depth = tree_positions(parents)
        start = int(starts[b])
        runner.positions[start : start + k + 1] = torch.from_numpy(int(computed[b]) + depth)
    registry.clear()  # proposed for this step only
    _step["parents"] = rows
    _step["cache_lens"] = torch.from_numpy(computed.astype(np.int32))
    _step["starts"] = starts[:num_reqs].tolist()


def _hand_over_step(runner, scheduler_output, sampled_token_ids, hidden_states, aux) -> None:
    """The step's hidden states and emitted tokens to the hosted drafter (hosted.HostedStep),
    and the batch rows' requests for its propose()."""
    from specdec.integrations.vllm.hosted import HostedStep

    batch = runner.input_batch
    req_ids = list(batch.req_ids[: batch.num_reqs])
    spec = scheduler_output.scheduled_spec_decode_tokens
    step = HostedStep(
        req_ids,
        [int(scheduler_output.num_scheduled_tokens[q]) for q in req_ids],
        _step["cache_lens"][: len(req_ids)].tolist(),
        [len(spec.get(q, ())) for q in req_ids],
        _step["starts"],
        hidden_states,
        torch.cat(aux, dim=-1) if aux else None,
        [list(s) for s in sampled_token_ids],
        batch.token_ids_cpu,
        set(scheduler_output.finished_req_ids),
    )
    runner.drafter.observe(step)
    runner.drafter.bind_rows(req_ids)


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

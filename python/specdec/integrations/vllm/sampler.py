"""vLLM's rejection sampling through torch.ops.specdec.tree_rejection_sample.

vLLM's RejectionSampler.forward applies everything that shapes the target distribution
(logits processors, penalties, bad words, temperature, top-k, top-p) to the draft positions'
logits and samples the bonus token with its own sampler, then calls the module-level
`rejection_sample` for the accept / recover walk. `rejection_sample` below replaces that
function (install()). A chain of drafts is a tree; each request's chain is one row of the op's
batch, with temperature 0 for greedy requests (the argmax, ties to the lowest id, as vLLM's
argmax) and 1 for sampled ones (vLLM already divided by the temperature and masked top-k /
top-p). Three layouts, the same result:

- every request has K drafts and they are point masses (draft_probs None; vLLM's eagle,
  eagle3, medusa and n-gram methods in steady decoding): vLLM's [B * K, V] logits *are* a
  [B, K, V] batch of K-node chains (node 0 the root, node j < K draft j, node j's logits
  deciding draft j + 1), passed without a copy. The op's bonus token is then a sample y of the
  target at the last draft's position: draft K is accepted iff y equals it (for a point-mass
  draft this is rejection sampling's own rule: accepted with probability p(x), and a rejected
  y is p conditioned on y != x, the residual), and then vLLM's bonus token follows. A tree
  step (trees.py) with K nodes a request walks the same rows with the step's tree parents,
  its last node checked the same way (`_walk_uniform`).
- point-mass drafts of different counts (an arrival beside speculating requests, trees of
  several sizes): the same walk once per draft count over its requests' rows, a slice of
  vLLM's logits where those requests are consecutive, else gathered (`_walk_by_draft_count`;
  32 requests, half with 6 drafts, V = 49152, float32: 5.7 ms a step against the padded
  copy's 13.3, docs/benchmarks.md "Trees inside vLLM").
- otherwise (draft distributions, placeholder drafts): a [B, K + 1, V] copy, node
  k_b holding vLLM's bonus token as a point mass (0 at the token, -inf elsewhere), so that an
  all-accepted chain emits exactly vLLM's bonus token.

The op's output rows (accepted drafts, then the recovered or bonus token, then -1) are vLLM's
output rows.

install() also replaces the rejection sampler's `expand_batch_to_tokens` (per-request
temperature, top-k and top-p repeated per draft token before vLLM processes the logits): vLLM
0.32's CPU build runs it through a C++ kernel that writes into an int64 copy of its output
unless the output is int64 already, so float temperatures and int32 top-k come back as
uninitialised memory and sampled speculative decoding on CPU draws from garbage-scaled
logits (tests/integrations/test_vllm_sampler.py shows it). The replacement is
torch.repeat_interleave, the same values the GPU kernel computes.

Uniforms come from the request's own generator when it has a seed (vLLM's
`generators`), else torch's. The distribution is the target's (the op's rule, docs/ops.md);
greedy output equals vLLM's token for token. vLLM's synthetic acceptance mode is not
rejection sampling: it goes to vLLM's own function unchanged.
"""

import contextlib
import functools

import torch

import specdec_kernels  # noqa: F401  (registers torch.ops.specdec)

_original = None  # vLLM's rejection_sample, kept by install() for restore()
_original_expand = None  # vLLM's expand_batch_to_tokens, likewise


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list,
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """vLLM's rejection_sample contract: draft_token_ids [N] (N = sum(num_draft_tokens)),
    target_logits [N, V] (processed), draft_probs [N, V] or None, bonus_token_ids [B, 1]
    -> output_token_ids int32 [B, max_spec_len + 1], -1 past each request's tokens."""
    if synthetic_mode:
        return _vllm_rejection_sample()(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            synthetic_mode=synthetic_mode,
            synthetic_conditional_rates=synthetic_conditional_rates,
            use_fp64_gumbel=use_fp64_gumbel,
        )
    B, K = len(num_draft_tokens), max_spec_len
    if K == 0:  # no drafts in the step: every request emits its bonus token, vLLM's sample
        return bonus_token_ids.view(B, 1).to(torch.int32)
    device = target_logits.device
    fixed = _fixed_inputs(B, K, str(device))
    temperature = (
        fixed.greedy_temperature
        if sampling_metadata.all_greedy
        else (sampling_metadata.temperature != 0).to(torch.float32)  # 0: vLLM's greedy mark
    )
    from specdec.integrations.vllm import trees

    in_tree_step = bool(trees.step_parents())
    V = target_logits.shape[-1]
    placeholders = bool(((draft_token_ids < 0) | (draft_token_ids >= V)).any())
    if not placeholders and draft_probs is None and target_logits.is_contiguous():
        # chains or trees over vLLM's logits as they are, each request's last node after
        parents = None
        if in_tree_step:  # chains overwritten by the step's trees (trees.py)
            parents = fixed.parents.clone()
            trees.write_step_trees(parents)
        uniforms = _uniforms(sampling_metadata, num_draft_tokens, K + 1, fixed).to(device)
        bonus = bonus_token_ids.view(-1).to(torch.int32)
        if all(n == K for n in num_draft_tokens):  # the batch-1 step's path: no host sync
            walk_parents, last_parent = fixed.chain_parents, fixed.last_chain_parent
            if parents is not None:
                walk_parents, last_parent = parents[:, :K].contiguous(), parents[:, K]
            accepted_nodes, num_accepted, output = _walk_uniform(
                draft_token_ids.view(B, K).to(torch.int32),
                target_logits.view(B, K, -1),
                bonus,
                walk_parents,
                last_parent,
                temperature,
                uniforms,
                fixed,
                in_tree_step,
            )
        else:
            accepted_nodes, num_accepted, output = _walk_by_draft_count(
                draft_token_ids,
                num_draft_tokens,
                target_logits,
                bonus,
                parents,
                temperature,
                uniforms,
            )
        if in_tree_step:
            trees.record_acceptance(accepted_nodes, num_accepted)
        return output
    tree = chain_batch(
        draft_token_ids, num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids
    )
    if in_tree_step:  # trees inside vLLM's step (trees.py): the drafted parents
        trees.write_step_trees(tree.parents)
    accepted_nodes, num_accepted, output_tokens = tree.walk(
        temperature,
        fixed.top_k,
        fixed.top_p,
        _uniforms(sampling_metadata, num_draft_tokens, K + 2, fixed).to(device),  # T = K + 1
    )
    if in_tree_step:
        trees.record_acceptance(accepted_nodes, num_accepted)
    return output_tokens


def _walk_uniform(
    drafts, logits, bonus, walk_parents, last_parent, temperature, uniforms, fixed, with_nodes
):
    """A step whose every request drafted K nodes, without the padded copy: drafts [B, K]
    int32 (node j + 1's token), logits [B, K, V] (vLLM's rows of nodes 0 .. K - 1), bonus [B]
    int32 (vLLM's sample at node K), walk_parents [B, K] int32 (nodes 0 .. K - 1: chains, or
    the step's trees), last_parent [B] (node K's) -> (accepted_nodes [B, K + 1], num_accepted
    [B], output tokens [B, K + 1]), int32; the first two None unless with_nodes (a tree step's
    compact_kv needs them). No host sync: the batch-1 step's hot path.

    The op walks nodes 0 .. K - 1; node K (the last, a leaf) is checked after: its siblings
    hold other tokens, so the walk stopping at K's parent with K's token emitted is exactly
    the walk accepting K tried last among its siblings (greedy: the parent's argmax is K's
    token; sampled: the residual draw is K's token with the probability rejection sampling
    accepts K; any sibling order keeps the target's distribution; in a chain K has no
    siblings and this is rejection sampling's own rule for a point-mass draft), and then
    vLLM's bonus token follows."""
    K = drafts.shape[1]
    tokens = torch.cat((fixed.zero_column, drafts[:, :-1]), dim=1)  # node 0 is unused
    accepted_nodes, num_accepted, output = torch.ops.specdec.tree_rejection_sample(
        logits,
        tokens,
        walk_parents,
        fixed.num_nodes,
        None,
        temperature,
        fixed.top_k,
        fixed.top_p,
        uniforms,
    )
    n = num_accepted.long()[:, None]
    stopped_at = accepted_nodes.gather(1, n).squeeze(1)  # where the walk stopped
    emitted = output.gather(1, n).squeeze(1)
    takes_last = _accepts_last(stopped_at, last_parent, emitted, drafts[:, K - 1])
    # past the walk's last token the rows hold -1: write node K and the bonus token there,
    # or -1 again where the walk did not take node K
    output = torch.cat((output, fixed.minus_one_column), dim=1)
    output.scatter_(1, n + 1, torch.where(takes_last, bonus, -1)[:, None])
    if not with_nodes:  # a chain step: nothing to compact
        return None, None, output
    accepted_nodes = torch.cat((accepted_nodes, fixed.minus_one_column), dim=1)
    accepted_nodes.scatter_(1, n + 1, torch.where(takes_last, K, -1).to(torch.int32)[:, None])
    return accepted_nodes, num_accepted + takes_last.to(num_accepted.dtype), output


def _walk_by_draft_count(
    draft_token_ids, num_draft_tokens, logits, bonus, parents, temperature, uniforms
):
    """A step whose requests drafted different counts (arrivals beside speculating requests,
    trees of several sizes), without the padded [B, K + 1, V] copy: one _walk_uniform per
    draft count k > 0 over the requests with k drafts, their logits rows a slice of vLLM's
    when the requests are consecutive, else gathered (their k rows each, not K + 1); a
    request without drafts emits vLLM's bonus token. draft_token_ids [N], logits [N, V]
    (contiguous), bonus [B] int32, parents [B, K + 1] int32 (the step's trees) or None
    (chains), temperature [B], uniforms [B, K + 1] -> (accepted_nodes [B, K + 1],
    num_accepted [B], output tokens [B, K + 1]), int32, -1 past each request's nodes and
    tokens."""
    B, K, dev = len(num_draft_tokens), max(num_draft_tokens), logits.device
    counts = torch.tensor(num_draft_tokens)
    starts = torch.cumsum(counts, 0) - counts  # each request's first logits row
    output = torch.full((B, K + 1), -1, dtype=torch.int32, device=dev)
    output[:, 0] = bonus  # a request without drafts; overwritten for the others
    accepted_nodes = torch.full((B, K + 1), -1, dtype=torch.int32, device=dev)
    accepted_nodes[:, 0] = 0  # the root
    num_accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    for k in sorted(set(num_draft_tokens) - {0}):
        requests = (counts == k).nonzero().view(-1)
        n, first = len(requests), int(requests[0])
        if int(requests[-1]) - first + 1 == n:  # consecutive: one slice of vLLM's rows
            rows = slice(int(starts[first]), int(starts[first]) + n * k)
            group_logits, group_drafts = logits[rows], draft_token_ids[rows]
        else:
            rows = (starts[requests][:, None] + torch.arange(k)).view(-1).to(dev)
            group_logits, group_drafts = logits.index_select(0, rows), draft_token_ids[rows]
        fixed = _fixed_inputs(n, k, str(dev))
        at = requests.to(dev)
        walk_parents, last_parent = fixed.chain_parents, fixed.last_chain_parent
        if parents is not None:
            walk_parents, last_parent = parents[at, :k].contiguous(), parents[at, k]
        nodes, accepted, out = _walk_uniform(
            group_drafts.view(n, k).to(torch.int32),
            group_logits.view(n, k, -1),
            bonus[at],
            walk_parents,
            last_parent,
            temperature[at],
            uniforms[at, : k + 1].contiguous(),
            fixed,
            parents is not None,
        )
        output[at, : k + 1] = out
        if parents is not None:
            accepted_nodes[at, : k + 1] = nodes
            num_accepted[at] = accepted
    return accepted_nodes, num_accepted, output


def _accepts_last(stopped_at, parent, emitted, token) -> torch.Tensor:
    """[B] bool: the walk accepts the last node (_walk_uniform): it stopped at that node's
    parent and emitted that node's token."""
    return (stopped_at == parent) & (emitted == token)


def chain_parents(B: int, T: int, device) -> torch.Tensor:
    """parents [B, T] of T-node chains: node j's parent is j - 1 (the root's -1)."""
    return (torch.arange(T, dtype=torch.int32) - 1).expand(B, T).contiguous().to(device)


class _FixedInputs:
    """The op's inputs that depend on the batch shape only (B requests, chains of up to K
    drafts), built once per shape: vLLM's steps repeat a few shapes, and at batch 1 these
    small tensors cost as much as the walk itself."""

    def __init__(self, B: int, K: int, device: str):
        self.parents = chain_parents(B, K + 1, device)  # chains of K + 1 nodes
        self.chain_parents = self.parents[:, :K].contiguous()  # the walk's K nodes of them
        self.last_chain_parent = self.parents[:, K].contiguous()  # node K's: K - 1
        self.minus_one_column = torch.full((B, 1), -1, dtype=torch.int32, device=device)
        self.num_nodes = torch.full((B,), K, dtype=torch.int32, device=device)
        self.top_k = torch.zeros(B, dtype=torch.int32, device=device)  # 0: off (vLLM applied it)
        self.top_p = torch.ones(B, device=device)  # 1.0: off (vLLM applied it)
        self.zero_column = torch.zeros(B, 1, dtype=torch.int32, device=device)
        self.greedy_temperature = torch.zeros(B, device=device)  # temperature 0: the argmax
        self.greedy_uniforms = {w: torch.zeros(B, w) for w in (K + 1, K + 2)}


@functools.lru_cache(maxsize=64)
def _fixed_inputs(B: int, K: int, device: str) -> _FixedInputs:
    return _FixedInputs(B, K, device)


class ChainBatch:
    """A batch of chains as tree_rejection_sample takes it (T = max_spec_len + 1 nodes):
    logits [B, T, V], tokens [B, T] (node 0 unused), parents [B, T], num_nodes [B],
    draft_probs [B, T, V] or None."""

    def __init__(self, logits, tokens, parents, num_nodes, draft_probs):
        self.logits, self.tokens, self.parents = logits, tokens, parents
        self.num_nodes, self.draft_probs = num_nodes, draft_probs

    def walk(self, temperature, top_k, top_p, uniforms):
        """tree_rejection_sample over the batch: temperature [B], top_k [B] int32, top_p [B],
        uniforms [B, T + 1] -> (accepted_nodes, num_accepted, output_tokens)."""
        return torch.ops.specdec.tree_rejection_sample(
            self.logits,
            self.tokens,
            self.parents,
            self.num_nodes,
            self.draft_probs,
            temperature,
            top_k,
            top_p,
            uniforms,
        )


def chain_batch(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> ChainBatch:
    """vLLM's flattened drafts -> ChainBatch (see the module docstring). Padding nodes (past a
    request's num_nodes) are never read by the op and are left unset. A draft outside the
    vocabulary (the -1 placeholders vLLM's scheduler pads a request's drafts with) ends its
    request's row: the row keeps the nodes before it (the placeholder is never accepted) and
    no bonus point mass (the walk samples from the last kept node's logits)."""
    B, T, V = len(num_draft_tokens), max_spec_len + 1, target_logits.shape[-1]
    dev = target_logits.device
    counts = torch.tensor(num_draft_tokens, dtype=torch.long)
    request = torch.repeat_interleave(torch.arange(B), counts)  # [N]: each draft's request
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(request)) - starts[request]  # [N]: j, the draft's index
    draft_rows = (request * T + position).to(dev)  # the node whose logits decide draft j + 1
    bonus_rows = (torch.arange(B) * T + counts).to(dev)  # node k_b: the bonus point mass

    logits = torch.empty(B * T, V, dtype=target_logits.dtype, device=dev)
    logits.index_copy_(0, draft_rows, target_logits)
    logits[bonus_rows] = float("-inf")
    logits[bonus_rows, bonus_token_ids.view(-1).to(dev)] = 0.0

    num_nodes = counts + 1
    invalid = ((draft_token_ids < 0) | (draft_token_ids >= V)).cpu()
    if bool(invalid.any()):
        first = torch.where(invalid, position, counts[request])  # a row's first placeholder
        kept = counts.clone().scatter_reduce_(0, request, first, "amin")
        num_nodes = kept + 1
        draft_token_ids = torch.where(invalid.to(dev), 0, draft_token_ids)
    tokens = torch.zeros(B * T, dtype=torch.int32, device=dev)
    tokens.index_copy_(0, draft_rows + 1, draft_token_ids.to(torch.int32))  # draft j is node j+1
    parents = chain_parents(B, T, dev)
    probs = None
    if draft_probs is not None:
        probs = torch.zeros(B * T, V, dtype=draft_probs.dtype, device=dev)
        probs.index_copy_(0, draft_rows, draft_probs)
        probs = probs.view(B, T, V)
    return ChainBatch(
        logits.view(B, T, V),
        tokens.view(B, T),
        parents,
        num_nodes.to(torch.int32).to(dev),
        probs,
    )


def _uniforms(sampling_metadata, num_draft_tokens: list, width: int, fixed) -> torch.Tensor:
    """[B, width] uniforms in [0, 1): zeros when every request is greedy (nothing is drawn,
    as vLLM draws nothing then); a seeded request's from its own generator, and only when it
    has drafts (as vLLM, so that its stream depends on its own drafts only)."""
    B = len(num_draft_tokens)
    if sampling_metadata.all_greedy:
        return fixed.greedy_uniforms[width]
    uniforms = torch.rand(B, width)
    for b, generator in sampling_metadata.generators.items():
        if num_draft_tokens[b] > 0:
            uniforms[b] = torch.rand(width, generator=generator)
    return uniforms


def _vllm_rejection_sample():
    from vllm.v1.sample import rejection_sampler

    return _original or rejection_sampler.rejection_sample


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's contract: x [B] -> [num_tokens], request b's value repeated for its tokens
    (cu_num_tokens [B]: cumulative counts), replace_from replaced by replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def install() -> None:
    """Routes vLLM's rejection sampling (in this process) through rejection_sample above, and
    its per-token expansion of sampling parameters through expand_batch_to_tokens."""
    global _original, _original_expand
    from vllm.v1.sample import rejection_sampler

    if rejection_sampler.rejection_sample is not rejection_sample:
        _original = rejection_sampler.rejection_sample
        rejection_sampler.rejection_sample = rejection_sample
    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        _original_expand = rejection_sampler.expand_batch_to_tokens
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def restore() -> None:
    """Gives vLLM its own rejection sampling back (in this process)."""
    from vllm.v1.sample import rejection_sampler

    if _original is not None:
        rejection_sampler.rejection_sample = _original
    if _original_expand is not None:
        rejection_sampler.expand_batch_to_tokens = _original_expand


@contextlib.contextmanager
def routed():
    """install() for the duration of a with block (one RejectionSampler.forward), then what
    was there before back."""
    from vllm.v1.sample import rejection_sampler

    before = rejection_sampler.rejection_sample, rejection_sampler.expand_batch_to_tokens
    install()
    try:
        yield
    finally:
        rejection_sampler.rejection_sample, rejection_sampler.expand_batch_to_tokens = before


def installed() -> bool:
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler.rejection_sample is rejection_sample

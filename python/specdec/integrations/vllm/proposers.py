"""specdec's drafters that need no target hidden states, as vLLM custom_class proposers.

    speculative_config("ngram")  # {"method": "custom_class", "model": ".../NgramProposer", ...}

vLLM builds the class as `NgramProposer(vllm_config)` in each worker, calls `load_model(target)`
once and then, every step, `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)` for the whole batch in batch order: each row's history is
`token_ids_cpu[i, :num_tokens_no_spec[i]]` (prompt and output, the step's sampled tokens
included); a row gets a list of at most num_speculative_tokens draft tokens. The proposer sees
no request ids and no hidden states, so only history-only drafters fit (the EAGLE heads go
through vLLM's own eagle methods; trees need vLLM's step itself).

Drafts are token lists (point masses): whichever tokens are proposed, vLLM's rejection sampling
(or specdec's, sampler.py) keeps the output exactly the target's. Exact by construction.
"""

import numpy as np

from specdec.drafters import NgramDrafter
from specdec.integrations.vllm.options import specdec_options


class NgramProposer:
    """specdec's n-gram drafter (NgramDrafter's matching: the longest suffix n-gram, n from
    ngram_max down to ngram_min, and the continuations of its most recent occurrences), its
    best chain per request: the path of the continuations' trie that the most occurrences
    share, level by level (ties: the most recent occurrence's token), up to
    num_speculative_tokens tokens."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        options = specdec_options(vllm_config)
        self.depth = int(spec.num_speculative_tokens)
        self.drafter = NgramDrafter(options.get("ngram_max", 4), options.get("ngram_min", 1))
        self.drafter.depth = self.depth  # match() returns continuations this long
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def load_model(self, target_model) -> None:
        """No model: drafting reads the request's tokens only."""

    def propose(
        self,
        sampled_token_ids: list,
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list:
        """One draft list per row of the batch (see the module docstring); [] for a row that
        sampled nothing this step (a partial prefill) or has no room left."""
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.depth, self.max_model_len - n)
            if not len(sampled) or room <= 0:
                drafts.append([])
                continue
            _, continuations = self.drafter.match(token_ids_cpu[i, :n])
            drafts.append(best_chain(continuations, room))
        return drafts


def best_chain(continuations: list, depth: int) -> list:
    """continuations (token lists, most recent first) -> the chain that the most of them
    share, level by level (ties: the most recent one's token), at most depth tokens."""
    chain: list = []
    alive = [c for c in continuations if c]
    while alive and len(chain) < depth:
        level = len(chain)
        counts: dict = {}
        for c in alive:  # dicts keep insertion order: the most recent token first
            counts[c[level]] = counts.get(c[level], 0) + 1
        token = max(counts, key=counts.__getitem__)
        chain.append(int(token))
        alive = [c for c in alive if c[level] == token and len(c) > level + 1]
    return chain

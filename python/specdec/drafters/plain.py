"""Plain decoding as a drafter: every step proposes the one-node tree (root only, T = 1)."""

from specdec.drafters.base import Drafter, Proposal, root_only


class PlainDrafter(Drafter):
    name = "plain"

    def num_nodes(self, tree) -> int:
        return 1

    def check(self, tree, max_nodes: int) -> None:
        pass  # the tree spec is not used

    def start(self, slots, prompts, first_tokens, hidden, aux, ok) -> None:
        pass

    def propose(self, slots, roots, sampling, policy=None) -> Proposal:
        return root_only(roots)

    def commit(self, slots, proposal, result) -> None:
        pass

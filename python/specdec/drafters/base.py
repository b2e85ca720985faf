"""The drafter interface the engine loop knows (the pattern of vLLM's EagleProposer.propose).

Per step the engine asks the drafter for a `Proposal` (a draft tree per request, in the op
contract's format), verifies it with the target, samples, and tells the drafter what was
accepted (`commit`) so that it can advance its own state (caches, features, token history).
The engine never looks inside a drafter: a new one subclasses `Drafter` and is passed as
`Engine(model, tok, drafter=...)`; no line of the loop changes.

Life of a request in slot s (the engine's batch slot; reused by the next request once it
finishes, so `start` must reset whatever the slot held):
    start(slots, ...)                  once, after the target's prefill and first token
    propose(slots, ...) -> Proposal    every speculative step
    commit(slots, ...)                 after every step (plain ones included), accepted path
A drafter instance serves one engine (setup allocates its per-slot state for that engine).
Exactness does not depend on the drafter: any tree is verified by tree_rejection_sample,
which follows the target as long as draft_probs is the distribution each draft was drawn
from (or None for deterministic drafts, point masses).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.models.llama import Transformer
    from specdec.speculation.cost_model import CostModel, TargetForward
    from specdec.speculation.trees import BatchSampling, TreeSizer, TreeSpec


@dataclass
class Proposal:
    """The draft trees of one step, B requests, T nodes (padded).

    Node 0 is the root (the last emitted token, not yet in the target cache), parents[b, 0]
    = -1 and 0 <= parents[b, i] < i for 0 < i < num_nodes[b]; padding has parent -1."""

    tokens: torch.Tensor  # long [B, T]: node i's token (tokens[:, 0] = the roots)
    parents: torch.Tensor  # int32 [B, T]: parent node index, -1 for the root and the padding
    num_nodes: torch.Tensor  # int32 [B]: valid nodes of row b, root included (>= 1)
    # float [B, T, V]: row u = the distribution u's children were drawn from; None = point masses
    draft_probs: torch.Tensor | None = None
    # float [B, T]: P(node's token | parent) as the drafter sees it (adaptive mode's value
    # model calibrates it per depth); None outside adaptive mode
    confidence: torch.Tensor | None = None

    def truncate(self, room: torch.Tensor) -> "Proposal":
        """Keep at most room[b] >= 1 nodes of row b (the first ones: topological order keeps
        it a valid tree), so verification never writes past a request's cache."""
        T = self.tokens.shape[1]
        num_nodes = torch.minimum(self.num_nodes, room.to(self.num_nodes.dtype))
        keep = torch.arange(T, device=self.tokens.device)[None, :] < num_nodes[:, None]
        return type(self)(
            self.tokens.masked_fill(~keep, 0),
            self.parents.masked_fill(~keep, -1),
            num_nodes,
            self.draft_probs,
            self.confidence,
        )


def root_only(root_tokens: torch.Tensor) -> Proposal:
    """The one-node tree (root only, T = 1): a plain decoding step."""
    B = root_tokens.shape[0]
    dev = root_tokens.device
    return Proposal(
        root_tokens[:, None].clone(),
        torch.full((B, 1), -1, dtype=torch.int32, device=dev),
        torch.ones(B, dtype=torch.int32, device=dev),
    )


@dataclass
class Setup:
    """What the engine tells a drafter once, before any request (Drafter.setup)."""

    model: "Transformer"
    tree: "TreeSpec"
    batch_size: int  # slots: slot ids are in [0, batch_size)
    capacity: int  # target cache positions per request (prompt + generated)
    block_size: int
    device: torch.device


@dataclass
class StepResult:
    """What the target accepted in one step (Drafter.commit); rows follow `slots`."""

    accepted_nodes: torch.Tensor  # int32 [B, T]: the accepted path's node indices, -1 padded
    num_accepted: torch.Tensor  # int32 [B]: accepted drafts (the path has num_accepted + 1 nodes)
    output_tokens: (
        torch.Tensor
    )  # int32 [B, T]: the emitted tokens (num_accepted + 1 of them), -1 padded
    hidden: torch.Tensor  # [B, T, dim]: the target's last hidden state of each verified node
    aux: tuple  # the target's hidden states at Drafter.feature_layers, [B, T, dim] each
    ok: list  # bool per row: False for a request that failed (its row is inert; skip it)


class Drafter(ABC):
    """Proposes draft trees and keeps whatever state it needs per engine slot."""

    name: str = "drafter"
    feature_layers: tuple = ()  # target layers whose hidden states commit() needs in .aux
    adaptive: bool = False  # supports TreeSpec "adaptive" (confidences + a cost model)

    # ------------------------------------------------------------------ sizing (before setup)
    def num_nodes(self, tree: "TreeSpec") -> int:
        """T: the most nodes (root included) a proposal can have under tree."""
        return tree.num_nodes

    def check(self, tree: "TreeSpec", max_nodes: int) -> None:
        """InvalidTreeSpecError when tree cannot be drafted (max_nodes: the most the model's
        context allows)."""
        tree.check_fits(max_nodes)

    def cache_positions(self, tree: "TreeSpec", capacity: int) -> int:
        """KV positions per request of the drafter's own cache (for the engine's memory check)."""
        return 0

    def measure_cost(
        self,
        model: "Transformer",
        tree: "TreeSpec",
        batch_size: int,
        target_forward: "TargetForward | None" = None,
    ) -> "CostModel":
        """Adaptive mode's cost model on this machine (only called when .adaptive).
        target_forward: the verify forward the steps run, when not model's (CostModel.measure);
        model is then the drafter's own copy (None for drafters without model calls)."""
        raise NotImplementedError(f"the {self.name} drafter has no adaptive mode")

    def modules(self) -> list[torch.nn.Module]:
        """The modules it runs (Engine.generate trusts them not to change while it runs:
        specdec.cpu.modules_unchanged)."""
        return []

    # ------------------------------------------------------------------ per run
    def setup(self, setup: Setup) -> None:  # noqa: B027 (an optional hook: most drafters keep no state)
        """Allocates per-slot state (called once by the engine)."""

    @abstractmethod
    def start(
        self,
        slots: torch.Tensor,
        prompts: list[torch.Tensor],
        first_tokens: torch.Tensor,
        hidden: list[torch.Tensor],
        aux: list[torch.Tensor],
        ok: list[bool],
    ) -> None:
        """New requests in slots (long [B]): prompts (long [S_b] each), first_tokens (long [B],
        sampled from the prefill), the target's prefill hidden states per request ([S_b, dim]
        final-norm outputs; aux: [S_b, len(feature_layers) * dim]); ok[b] False: the request
        already failed."""

    @abstractmethod
    def propose(
        self,
        slots: torch.Tensor,
        roots: torch.Tensor,
        sampling: "BatchSampling",
        policy: "TreeSizer | None" = None,
    ) -> Proposal:
        """Draft trees for the requests in slots (long [B]) rooted at roots (long [B], the
        last emitted tokens). sampling: the requests' parameters and generators (a drafter
        that samples must draw from their generators and pass draft_probs). policy: adaptive
        mode's tree sizer (fill .confidence, size the tree with it; docs/adaptive.md)."""

    @abstractmethod
    def commit(self, slots: torch.Tensor, proposal: Proposal, result: StepResult) -> None:
        """After verification: result says which of proposal's nodes were accepted."""

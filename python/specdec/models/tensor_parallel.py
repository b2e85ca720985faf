"""Tensor parallelism: the target's attention heads and MLP split over N ranks (torchrun).

The ops are per shard. `shard_model` gives each rank (the Megatron-LM / vLLM / gpt-fast layout):
  - attention: a column-parallel wqkv holding this rank's Hq / N query heads and Hkv / N KV
    heads (contiguous ranges, so every GQA group stays whole on one rank); its PagedKVCache
    (model.new_cache) holds only those KV heads, and tree_verify / compact_kv run over them;
    a row-parallel wo whose partial outputs are summed by an all_reduce;
  - MLP: a column-parallel w13 (the gate and the up halves both sliced) and a row-parallel
    w2 + all_reduce;
  - embeddings, norms and lm_head replicated (simplest: every rank has the full hidden states
    and logits after each layer's all_reduce; a vocabulary-parallel lm_head would need a
    gather of the logits before sampling anyway).

Sampling happens once per step: `BroadcastSampler` (the engine's `sampler`) runs
tree_rejection_sample on rank 0 and broadcasts the accepted nodes and the emitted tokens, so
the ranks cannot disagree on what was accepted (each then compacts its own heads' K/V). Every
rank still draws the step's uniforms (Engine._sample), which keeps each request's generator
in lockstep on all ranks.

Drafting is replicated: every rank runs the drafter (an EAGLE head is small next to the
target) on identical inputs, the hidden states after the all_reduce, the logits of the
replicated lm_head and the requests' generators, so every rank proposes the same trees
without broadcasting them. Adaptive mode times forwards on each rank: `init` makes every
timing the maximum over the ranks (agree_time) so that all ranks measure the same
sizes and their policies take the same decisions (their forwards must match call for call).

Launch (one process per rank; gloo on CPU, NCCL on GPUs, one GPU per rank):
    torchrun --nproc-per-node 2 -m specdec generate --tp 2 --prompt "Why is the sky blue?"
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import specdec_kernels.ops as ops
from specdec.errors import InvalidRequestError
from specdec.models.llama import Attention, FeedForward, Transformer, TransformerBlock


@dataclass
class Parallel:
    """This process's place in the tensor-parallel group (from torchrun's environment)."""

    rank: int
    world: int
    device: torch.device  # cuda:LOCAL_RANK on GPUs


def init(world: int, device: torch.device | str = "cpu") -> Parallel:
    """Joins the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT): gloo on CPU, NCCL on CUDA (this rank's GPU: cuda:LOCAL_RANK). world: the
    --tp N asked for; it must be the number of processes launched."""
    device = torch.device(device)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InvalidRequestError(f"--tp must be an integer >= 1, got {world!r}")
    launched = os.environ.get("WORLD_SIZE")
    if launched is None or int(launched) != world:
        raise InvalidRequestError(
            f"--tp {world} needs {world} processes, one per rank "
            f"({'none launched by torchrun' if launched is None else f'WORLD_SIZE is {launched}'}):"
            f" launch with torchrun --nproc-per-node {world} -m specdec generate --tp {world} ..."
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
        )
    # requests without a seed draw their generator's seed from torch's global RNG: the same on
    # every rank, from rank 0's seed (their sampled drafts must agree)
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.long, device=device)
    dist.broadcast(seed, 0)
    torch.manual_seed(int(seed.item()))
    global _agreeing
    _agreeing = True
    return Parallel(rank, world, device)


def shutdown() -> None:
    """Leaves the process group (and the cost models time per process again)."""
    global _agreeing
    _agreeing = False
    if dist.is_initialized():
        # every rank done with its last collective before the group goes: a rank leaving
        # while another still talks to it aborted at exit ("terminate called without an
        # active exception", seen once in CI after correct output)
        dist.barrier()
        dist.destroy_process_group()


# whether agree_time takes the maximum over the ranks (between init and shutdown)
_agreeing = False


def agree_time(seconds: float, device: torch.device) -> float:
    """The seconds every process agrees on: under tensor parallelism (after init) the maximum
    over the ranks, so that every rank measures the same tree sizes and its adaptive policy
    takes the same decisions (the ranks' forwards must match call for call); else seconds."""
    if not _agreeing:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def check_shardable(args, world: int) -> None:
    """InvalidRequestError unless n_heads, n_kv_heads and the MLP's hidden_dim divide by world
    (a KV head and its query group must live on one rank)."""
    bad = [
        f"{name} = {getattr(args, name)}"
        for name in ("n_heads", "n_kv_heads", "hidden_dim")
        if getattr(args, name) % world
    ]
    if bad:
        sizes = (args.n_heads, args.n_kv_heads, args.hidden_dim)
        fits = [n for n in range(1, args.n_kv_heads + 1) if all(x % n == 0 for x in sizes)]
        raise InvalidRequestError(
            f"--tp {world}: the model cannot be split over {world} ranks: "
            f"{', '.join(bad)} not divisible by {world} (--tp can be "
            f"{', '.join(map(str, fits))})"
        )


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features: its partial outputs are
    summed over the ranks (all_reduce), so every rank gets the full output."""

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features / N] -> [..., out_features], summed over the ranks."""
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out)
        return out


def shard_model(model: Transformer, rank: int, world: int) -> Transformer:
    """Keeps this rank's heads and MLP slice in every layer of model (in place; -> model).
    world 1 leaves it whole. Needs an initialised process group for world > 1 (init)."""
    if world == 1:
        return model
    if getattr(model, "tp_world", 1) != 1:
        raise InvalidRequestError(f"the model is already split over {model.tp_world} ranks")
    if not 0 <= rank < world:
        raise InvalidRequestError(f"rank must be in [0, {world}), got {rank}")
    check_shardable(model.args, world)
    for layer in model.layers:
        assert isinstance(layer, TransformerBlock)
        _shard_attention(layer.attention, rank, world)
        _shard_mlp(layer.feed_forward, rank, world)
    model.tp_rank, model.tp_world = rank, world  # type: ignore[assignment]
    return model


def _linear(weight: Tensor, bias: Tensor | None, cls=nn.Linear) -> nn.Linear:
    """A Linear (or RowParallelLinear) holding copies of weight [out, in] and bias [out]."""
    lin = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin


def _shard_attention(attn: Attention, rank: int, world: int) -> None:
    """wqkv rows [q heads; k heads; v heads] -> this rank's contiguous range of each; wo's
    input columns (the query heads' outputs) -> this rank's."""
    D, Hq, Hkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    hq, hkv = Hq // world, Hkv // world
    dev = attn.wqkv.weight.device
    rows = torch.cat(
        [
            torch.arange(rank * hq * D, (rank + 1) * hq * D, device=dev),  # q
            Hq * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D, device=dev),  # k
            (Hq + Hkv) * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D, device=dev),  # v
        ]
    )
    bias = attn.wqkv.bias
    attn.wqkv = _linear(attn.wqkv.weight[rows], None if bias is None else bias[rows])
    heads = slice(rank * hq * D, (rank + 1) * hq * D)
    attn.wo = _linear(attn.wo.weight[:, heads], None, RowParallelLinear)
    attn.n_heads, attn.n_kv_heads = hq, hkv
    attn.qkv_sizes = [hq * D, hkv * D, hkv * D]


def _shard_mlp(mlp: FeedForward, rank: int, world: int) -> None:
    """w13 = [gate; up] rows -> this rank's slice of each half (so chunk(2) still splits gate
    from up); w2's input columns -> the same slice."""
    H = mlp.w2.weight.shape[1]
    h = H // world
    part = slice(rank * h, (rank + 1) * h)
    w13 = mlp.w13.weight
    mlp.w13 = _linear(torch.cat([w13[:H][part], w13[H:][part]]), None)
    mlp.w2 = _linear(mlp.w2.weight[:, part], None, RowParallelLinear)


class BroadcastSampler:
    """The engine's sampler under tensor parallelism: tree_rejection_sample (same arguments)
    runs on rank 0 only and its result, (accepted_nodes int32 [B, T], num_accepted int32 [B],
    output_tokens int32 [B, T]), is broadcast to every rank. Should it raise on rank 0, every
    rank raises (a RuntimeError with rank 0's message), so the engine's per-request fallback
    runs in step on all of them."""

    def __call__(self, logits: Tensor, draft_tokens: Tensor, *args):
        B, T = draft_tokens.shape
        n = B * T
        # one broadcast per step: [status, accepted_nodes, num_accepted, output_tokens]
        buf = torch.empty(1 + 2 * n + B, dtype=torch.int32, device=logits.device)
        error: Exception | None = None
        if dist.get_rank() == 0:
            try:
                acc, num, out = ops.tree_rejection_sample(logits, draft_tokens, *args)
                buf[0] = 0
                buf[1:] = torch.cat([acc.flatten(), num.flatten(), out.flatten()]).to(buf.dtype)
            except Exception as e:  # every rank must learn of it, or they wait forever
                error = e
                buf[0] = 1
        dist.broadcast(buf, 0)
        if buf[0].item():
            message = [str(error) if error is not None else None]
            dist.broadcast_object_list(message, 0, device=logits.device)
            if error is not None:
                raise error
            raise RuntimeError(message[0])
        return buf[1 : 1 + n].view(B, T), buf[1 + n : 1 + n + B], buf[1 + n + B :].view(B, T)

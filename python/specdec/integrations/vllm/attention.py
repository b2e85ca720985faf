"""An attention backend for vLLM's CPU platform that attends through torch.ops.specdec:
every row of a step (prefill chunks, plain decode, speculative trees) is one row of a
`tree_verify` batch over vLLM's paged KV cache, with the step's tree mask.

vLLM's own CPU backend (CPU_ATTN) keeps K and V packed per instruction set and knows causal
masks only, so a tree of drafts cannot be verified through it. This backend keeps vLLM's
allocation (per layer `[num_blocks, Hkv, block_size, 2 * D]`, layout LBHNC: K in the first D
channels, V in the last D) and reads it as the logical `[num_blocks, block_size, Hkv, D]`
strided views that specdec's ops take (docs/integration.md, "Layouts"), so `compact_kv` and
`tree_verify` run on the cache as vLLM allocated it.

Row b of a step: its `cache_len = seq_len - query_len` cached tokens, then `query_len` new
tokens at cache rows `cache_len + i` (vLLM's slot mapping). A row without drafts is a chain
(causal); a row with drafts takes the parents the runner registered for it (trees.py, the step
context), so node i attends to the cached tokens and its ancestors only.

Refused with a clear error: sliding windows, ALiBi, logit soft-capping, attention sinks,
quantized KV caches and non-decoder attention (the tree runner supports Llama-family
decoders).
"""

from dataclasses import dataclass

import torch

import specdec_kernels  # noqa: F401  (registers torch.ops.specdec)
from specdec.integrations.vllm import trees
from specdec.integrations.vllm.sampler import chain_parents
from specdec.integrations.vllm.trees import kv_views


def _is_decoder(attn_type) -> bool:
    """vLLM's attention type (a str enum member or its name) is decoder self-attention."""
    return str(attn_type).lower().split(".")[-1] == "decoder"


def _backend_base():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


@dataclass
class RowGroup:
    """Rows of a step that one tree_verify call attends, padded to the longest of them (B rows
    of up to T nodes).

    tokens: vLLM's flat tokens of these rows in order (a slice where the rows are consecutive,
    else [N_g] int64); pad_rows: [N_g] int64, the place b * T + i of each in the padded batch,
    or None when every row has T tokens (the flat tokens are the padded batch as they are);
    cache_lens, num_nodes: [B] int32; tree_mask: [B, T, ceil(T / 64)]; block_table:
    [B, max_blocks]."""

    B: int
    T: int
    tokens: slice | torch.Tensor
    pad_rows: torch.Tensor | None
    cache_lens: torch.Tensor
    num_nodes: torch.Tensor
    tree_mask: torch.Tensor
    block_table: torch.Tensor


@dataclass
class TreeAttentionMetadata:
    """One step's rows as tree_verify takes them: one RowGroup, or two when the step mixes
    prompt chunks with decode / tree rows (the short rows then are not padded to a prompt's
    length: a prompt of 200 tokens beside 19 decodes cost 1.37 ms a layer as one padded batch,
    0.70 ms as two; benchmarks/profile_step.py --part vllm). slot_mapping: [N]."""

    num_actual_tokens: int
    groups: list
    slot_mapping: torch.Tensor

    @property
    def dense(self) -> bool:
        """One group without padding (every plain decode step, trees of one size): no copies."""
        return len(self.groups) == 1 and self.groups[0].pad_rows is None


class TreeAttentionMetadataBuilder:
    """Builds TreeAttentionMetadata from vLLM's CommonAttentionMetadata and the parents the
    tree runner registered for this step (trees.step_parents())."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        from vllm.v1.attention.backend import AttentionMetadataBuilder

        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[arg-type]
        self.kv_cache_spec = kv_cache_spec

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        m = common_attn_metadata
        B = m.num_reqs
        starts = m.query_start_loc_cpu[: B + 1].long()
        query_lens = starts[1:] - starts[:-1]
        seq_lens = m.seq_lens[:B].cpu().long()
        T = max(int(query_lens.max()), 1)
        parents = chain_parents(B, T, "cpu")  # causal rows; nodes past num_nodes are not read
        trees.write_step_trees(parents)
        num_nodes = query_lens.to(torch.int32)
        tree_mask, _ = torch.ops.specdec.build_tree_mask(parents, num_nodes)
        block_table = m.block_table_tensor[:B]
        trees.note_block_table(block_table)
        step = _StepRows(
            starts,
            query_lens,
            (seq_lens - query_lens).to(torch.int32),
            num_nodes,
            tree_mask,
            block_table,
        )
        # decode and tree rows are at most as long as the longest tree; longer rows are
        # prompt chunks, attended apart so that the short rows are not padded to them
        short_len = max([len(p) for b, p in trees.step_parents().items() if b < B] + [1])
        short = query_lens <= short_len
        if bool(short.all()) or not bool(short.any()):
            groups = [step.group(None)]
        else:
            groups = [
                step.group(short.nonzero().squeeze(1)),
                step.group((~short).nonzero().squeeze(1)),
            ]
        return TreeAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            groups=groups,
            slot_mapping=m.slot_mapping,
        )


@dataclass
class _StepRows:
    """A step's per-row tensors (query_lens, cache_lens, num_nodes: [B]; starts: [B + 1];
    tree_mask: [B, T, ceil(T / 64)]; block_table: [B, max_blocks]), from which RowGroups are
    cut."""

    starts: torch.Tensor
    query_lens: torch.Tensor
    cache_lens: torch.Tensor
    num_nodes: torch.Tensor
    tree_mask: torch.Tensor
    block_table: torch.Tensor

    def group(self, rows: torch.Tensor | None) -> RowGroup:
        """The RowGroup of rows ([R] int64 batch rows, increasing; None: all of them)."""
        B = len(self.query_lens)
        if rows is None:
            query_lens, first, last = self.query_lens, 0, B - 1
            picked = lambda x: x  # noqa: E731
        else:
            query_lens, first, last = self.query_lens[rows], int(rows[0]), int(rows[-1])
            picked = lambda x: x.index_select(0, rows.to(x.device))  # noqa: E731
        R, T = len(query_lens), max(int(query_lens.max()), 1)
        if last - first + 1 == R:  # consecutive rows: consecutive tokens
            tokens: slice | torch.Tensor = slice(
                int(self.starts[first]), int(self.starts[last + 1])
            )
        else:
            token_row = torch.repeat_interleave(torch.arange(B), self.query_lens)
            tokens = torch.isin(token_row, rows).nonzero().squeeze(1)
        node = torch.arange(T)
        pad_rows = (node[None, :] < query_lens[:, None]).reshape(-1).nonzero().squeeze(1)
        words = (T + 63) // 64
        mask = picked(self.tree_mask)
        if mask.shape[1] != T or mask.shape[2] != words:
            mask = mask[:, :T, :words].contiguous()
        return RowGroup(
            B=R,
            T=T,
            tokens=tokens,
            pad_rows=None if len(pad_rows) == R * T else pad_rows,
            cache_lens=picked(self.cache_lens),
            num_nodes=picked(self.num_nodes),
            tree_mask=mask,
            block_table=picked(self.block_table),
        )


class TreeAttentionImpl:
    """forward: vLLM's AttentionImpl contract (query [N, Hq, D], key / value [N, Hkv, D],
    output [N, Hq, D] or [N, Hq * D])."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap=None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name=None,
        sinks=None,
    ) -> None:
        refused = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "sinks": sinks is not None,
            "kv_cache_dtype (quantized)": kv_cache_dtype not in ("auto", None),
            "attn_type (non-decoder)": not _is_decoder(attn_type),
        }
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise NotImplementedError(
                "specdec tree attention (vLLM plugin) supports plain decoder attention only; "
                f"this model's layer uses: {', '.join(bad)}"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sliding_window = None
        self.sinks = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Writes key / value [N, Hkv, D] at vLLM's slots (block * block_size + row)."""
        k_cache, v_cache = _layer_kv_views(layer, kv_cache, self.head_size)
        blocks, rows, keep = _slot_indices(slot_mapping, k_cache.shape[1])
        if keep is None:
            key, value = key[: len(blocks)], value[: len(blocks)]
        else:
            key, value = key.index_select(0, keep), value.index_select(0, keep)
        k_cache[blocks, rows] = key.to(k_cache.dtype)
        v_cache[blocks, rows] = value.to(v_cache.dtype)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("specdec tree attention: fused output quantization")
        if attn_metadata is None:  # vLLM's profiling / warm-up runs
            return output
        m = attn_metadata
        N = m.num_actual_tokens
        k_cache, v_cache = _layer_kv_views(layer, kv_cache, self.head_size)
        H, D = self.num_heads, self.head_size
        q = query[:N].view(N, H, D)
        result = output[:N].view(N, H * D)
        for g in m.groups:
            q_rows = q[g.tokens] if isinstance(g.tokens, slice) else q.index_select(0, g.tokens)
            if g.pad_rows is None:  # the flat tokens are the padded batch: no copies
                q_batch = q_rows
            else:  # padding nodes (past num_nodes) are never read: left uninitialised
                q_batch = q_rows.new_empty(g.B * g.T, H, D)
                q_batch.index_copy_(0, g.pad_rows, q_rows)
            out = torch.ops.specdec.tree_verify(
                q_batch.view(g.B, g.T, H, D),
                k_cache,
                v_cache,
                g.block_table,
                g.cache_lens,
                g.num_nodes,
                g.tree_mask,
                self.scale,
            )
            flat = out.reshape(g.B * g.T, H * D)
            if isinstance(g.tokens, slice):  # straight into vLLM's output
                if g.pad_rows is None:
                    result[g.tokens].copy_(flat)
                else:  # a prefill's rows are megabytes: gathered in place
                    torch.index_select(flat, 0, g.pad_rows, out=result[g.tokens])
            else:
                rows = flat if g.pad_rows is None else flat.index_select(0, g.pad_rows)
                result.index_copy_(0, g.tokens, rows)
        return output


def _layer_kv_views(layer, kv_cache: torch.Tensor, head_size: int):
    """kv_views of the layer's cache, kept on the layer: its cache lives as long as the engine,
    and building the views costs more than writing a decode step's K / V (profile_step.py
    --part vllm)."""
    if layer is None:  # called without vLLM's layer (tests): nowhere to keep them
        return kv_views(kv_cache, head_size)
    held = getattr(layer, "_specdec_kv_views", None)
    if held is None or held[0] is not kv_cache:
        held = (kv_cache, *kv_views(kv_cache, head_size))
        layer._specdec_kv_views = held
    return held[1], held[2]


# the last step's slot indices: every layer of a step gets the same slot_mapping tensor, the
# first layer computes them (holding the tensor, so its identity stays unique)
_slots: list = [None, 0, None]


def _slot_indices(slot_mapping: torch.Tensor, block_size: int):
    """vLLM's slots [N] -> (blocks, rows) [M] of the real ones and keep: None when all N are
    real, else the indices of the real ones (vLLM marks padding tokens' slots -1)."""
    if _slots[0] is not slot_mapping or _slots[1] != block_size:
        slots = slot_mapping.long()
        real = slots >= 0
        keep = None
        if not bool(real.all()):
            keep = real.nonzero().squeeze(1)
            slots = slots.index_select(0, keep)
        _slots[:] = [slot_mapping, block_size, (slots // block_size, slots % block_size, keep)]
    return _slots[2]


def backend_class():
    """The backend class (built on first use: it subclasses vLLM's CPU backend, which needs
    vLLM imported)."""
    global _BACKEND
    if _BACKEND is None:
        base = _backend_base()

        class SpecdecTreeAttentionBackend(base):  # type: ignore[misc, valid-type]
            """vLLM's CPU attention backend with specdec's tree attention (module docstring);
            same name, block sizes and cache allocation as CPU_ATTN."""

            forward_includes_kv_cache_update = False

            @classmethod
            def supports_non_causal(cls) -> bool:
                return False

            @classmethod
            def supports_sliding_window(cls) -> bool:
                return False

            @classmethod
            def supports_attn_type(cls, attn_type: str) -> bool:
                return _is_decoder(attn_type)

            @staticmethod
            def get_impl_cls():
                return _impl_class()

            @staticmethod
            def get_builder_cls():
                return _builder_class()

        _BACKEND = SpecdecTreeAttentionBackend
    return _BACKEND


def _impl_class():
    global _IMPL
    if _IMPL is None:
        from vllm.v1.attention.backend import AttentionImpl

        class SpecdecTreeAttentionImpl(TreeAttentionImpl, AttentionImpl):  # type: ignore[misc]
            pass

        _IMPL = SpecdecTreeAttentionImpl
    return _IMPL


def _builder_class():
    global _BUILDER
    if _BUILDER is None:
        from vllm.v1.attention.backend import AttentionMetadataBuilder

        class SpecdecTreeAttentionMetadataBuilder(
            TreeAttentionMetadataBuilder,
            AttentionMetadataBuilder,  # type: ignore[misc]
        ):
            pass

        _BUILDER = SpecdecTreeAttentionMetadataBuilder
    return _BUILDER


_BACKEND = None
_BUILDER = None
_IMPL = None
BACKEND_PATH = "specdec.integrations.vllm.attention.SpecdecTreeAttentionBackend"


def __getattr__(name: str):
    # vLLM resolves backends by qualified name: make the lazily built class importable
    if name == "SpecdecTreeAttentionBackend":
        return backend_class()
    raise AttributeError(name)

"""One layer's attention of a vLLM step: specdec's tree backend against vLLM's CPU_ATTN.

Both run on the same queries and the same K / V, each in its own cache layout (vLLM's
allocation `[num_blocks, Hkv, block_size, 2 * D]`: CPU_ATTN packs it per instruction set,
the tree backend reads it as strided views, docs/integration.md "Layouts"), through the
calls their `forward` makes: CPU_ATTN's `cpu_attention_with_kv_cache` with its scheduler
metadata, the tree backend's `TreeAttentionImpl.forward` on the metadata its builder makes
(the step's rows in one or two `tree_verify` calls). The K / V write is not timed. Shapes of
the default model (SmolLM2-135M: 9 query / 3 KV heads, D 64), block size 128 (vLLM's CPU
default); --layers caches are cycled so that each call reads K / V that a model's other
layers have pushed out of the caches, as in a forward. The two sides alternate call by call;
median of --iters calls each.

Steps (cache lengths of the decode rows drawn once, 100-400):
  prompt P alone; a prompt of 200 beside 19 decodes (an arrival); a chunk of 200 over 300
  cached tokens beside 19 decodes; 32 decodes; 1 and 8 rows of 9 tokens (a tree step's size).

    python benchmarks/bench_vllm_attention.py --threads 2 \
        --json benchmarks/results/<date>_<machine>_vllm-attention.json
"""

import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

from specdec.integrations.vllm import attention  # noqa: E402
from specdec_kernels import cpu_isa, set_cpu_isa  # noqa: E402

HQ, HKV, D, BLOCK_SIZE = 9, 3, 64, 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def steps(seed: int = 1) -> dict:
    """name -> (cache_lens, query_lens) of the step's rows."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(100, 400, (32,), generator=g).tolist()
    return {
        "prompt 200": ([0], [200]),
        "prompt 512": ([0], [512]),
        "prompt 200 + 19 decodes": ([0] + ctx[:19], [200] + [1] * 19),
        "chunk 200 over 300 + 19 decodes": ([300] + ctx[:19], [200] + [1] * 19),
        "32 decodes": (ctx, [1] * 32),
        "1 row of 9": ([250], [9]),
        "8 rows of 9": (ctx[:8], [9] * 8),
    }


class Step:
    """The inputs of one step's attention for both backends, over `layers` caches."""

    def __init__(self, cache_lens, query_lens, dtype, layers):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.isa = ops, _get_attn_isa(dtype, BLOCK_SIZE, D)
        if self.isa == "amx":  # the tile state needs the kernel's permission, as vLLM asks it
            torch.cpu._init_amx()
        B = len(cache_lens)
        seq = [c + q for c, q in zip(cache_lens, query_lens)]
        blocks = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq]
        self.block_table = torch.zeros(B, max(blocks), dtype=torch.int32)
        slots, nxt = [], 1
        for b in range(B):
            for j in range(blocks[b]):
                self.block_table[b, j] = nxt
                nxt += 1
            slots += [
                int(self.block_table[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(seq[b])
            ]
        slots_t = torch.tensor(slots, dtype=torch.long)
        k = torch.randn(len(slots), HKV, D).to(dtype)
        v = torch.randn(len(slots), HKV, D).to(dtype)
        self.vllm_caches, self.tree_caches = [], []
        for _ in range(layers):
            packed = torch.zeros(nxt, HKV, BLOCK_SIZE, 2 * D, dtype=dtype)
            key_cache, value_cache = packed.view(nxt, HKV, 2 * BLOCK_SIZE, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots_t, self.isa)
            self.vllm_caches.append((key_cache, value_cache))
            ours = torch.zeros(nxt, HKV, BLOCK_SIZE, 2 * D, dtype=dtype)
            kv = ours.transpose(1, 2)
            kv[..., :D][slots_t // BLOCK_SIZE, slots_t % BLOCK_SIZE] = k
            kv[..., D:][slots_t // BLOCK_SIZE, slots_t % BLOCK_SIZE] = v
            self.tree_caches.append((ours, types.SimpleNamespace()))  # a layer keeps its views
        N = sum(query_lens)
        self.query = torch.randn(N, HQ, D).to(dtype)
        self.key = torch.randn(N, HKV, D).to(dtype)
        self.query_start_loc = torch.tensor(
            [0] + torch.cumsum(torch.tensor(query_lens), 0).tolist(), dtype=torch.int32
        )
        self.seq_lens = torch.tensor(seq, dtype=torch.int32)
        self.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=B,
            num_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            seq_lens=self.seq_lens,
            dtype=dtype,
            query_start_loc=self.query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=False,
        )
        common = types.SimpleNamespace(
            num_reqs=B,
            num_actual_tokens=N,
            query_start_loc_cpu=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table_tensor=self.block_table,
            slot_mapping=slots_t[-N:],
        )
        builder = attention.TreeAttentionMetadataBuilder.__new__(
            attention.TreeAttentionMetadataBuilder
        )
        self.tree_metadata = builder.build(0, common)
        self.impl = attention.TreeAttentionImpl(HQ, D, D**-0.5, HKV, None, None, "auto")
        self.out_vllm = torch.empty(N, HQ, D, dtype=dtype)
        self.out_tree = torch.empty(N, HQ * D, dtype=dtype)
        self.calls = [0, 0]

    def vllm(self):
        key_cache, value_cache = self.vllm_caches[self.calls[0] % len(self.vllm_caches)]
        self.calls[0] += 1
        self.ops.cpu_attention_with_kv_cache(
            query=self.query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=self.out_vllm,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            scale=D**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=self.block_table,
            softcap=0.0,
            scheduler_metadata=self.scheduler_metadata,
            s_aux=None,
        )

    def tree(self):
        kv_cache, layer = self.tree_caches[self.calls[1] % len(self.tree_caches)]
        self.calls[1] += 1
        self.impl.forward(
            layer, self.query, self.key, self.key, kv_cache, self.tree_metadata, self.out_tree
        )


def main():
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--layers", type=int, default=30, help="caches cycled (the model's depth)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--tree-isas",
        default="",
        help="comma-separated specdec_kernels.set_cpu_isa caps to time the tree backend under, "
        "each its own side of the alternation (amx,avx512bf16: the AMX tiles against "
        "vdpbf16ps); default: the widest build this CPU runs",
    )
    ap.add_argument("--steps", default="", help="comma-separated step names to run (default: all)")
    opts = ap.parse_args()
    isas = [isa for isa in opts.tree_isas.split(",") if isa] or [None]
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    meta_isas = [isa or cpu_isa() for isa in isas]
    dtype = DTYPES[opts.dtype]
    rows, meta = (
        [],
        {
            "threads": opts.threads,
            "dtype": opts.dtype,
            "layers": opts.layers,
            "tree_isas": meta_isas,
            "load_before": list(os.getloadavg()),
        },
    )
    wanted = [name for name in opts.steps.split(",") if name]
    for name, (cache_lens, query_lens) in steps().items():
        if wanted and name not in wanted:
            continue
        step = Step(cache_lens, query_lens, dtype, opts.layers)
        for _ in range(5):
            step.vllm()
            step.tree()
        err = (step.out_vllm.view(len(step.query), -1).float() - step.out_tree.float()).abs().max()
        times: dict = {"vllm": [], **{isa: [] for isa in isas}}
        for _ in range(opts.iters):  # alternated call by call
            for side in times:
                if side != "vllm":
                    set_cpu_isa(side)
                t0 = time.perf_counter()
                step.vllm() if side == "vllm" else step.tree()
                times[side].append(time.perf_counter() - t0)
        set_cpu_isa(None)
        tree_us = {isa or cpu_isa(): statistics.median(times[isa]) * 1e6 for isa in isas}
        row = {
            "step": name,
            "cpu_attn_us": statistics.median(times["vllm"]) * 1e6,
            "specdec_tree_us": next(iter(tree_us.values())),
            "specdec_tree_us_by_isa": tree_us,
            "max_abs_diff": float(err),
        }
        row["ratio"] = row["specdec_tree_us"] / row["cpu_attn_us"]
        rows.append(row)
        trees = "  ".join(f"specdec[{isa}] {us:8.1f} us" for isa, us in tree_us.items())
        print(
            f"{name:34s} CPU_ATTN {row['cpu_attn_us']:8.1f} us  {trees}"
            f"  ratio {row['ratio']:.2f}  max |diff| {err:.1e}",
            flush=True,
        )
        if opts.json:
            write_json(opts.json, rows, dict(meta, load_after=list(os.getloadavg())))


if __name__ == "__main__":
    main()

"""What one EAGLE draft level costs, part by part (issue 14: make the cheapest draft step).

One draft level = the head run on M new tree nodes (children of the root) over a head cache
of CONTEXT committed positions, then the draft lm_head and the top-k of a dynamic tree:
    build_tree_mask -> metadata (cache rows) -> embed + RoPE -> fc (EAGLE-2; EAGLE-3 skips it
    at draft nodes: its feature there is its own dim-wide output) / the two input norms
    (EAGLE-3) -> q/k/v projection -> attention op (cache write + tree_verify) -> o-projection
    -> MLP (norm + gate/up + down) -> draft lm_head -> log_softmax + top-k.
Each part is timed alone (perf_counter, median of REPS, all parts and configurations
interleaved round-robin so a load change hits them alike); `level` is the real thing
(HeadTree.add's build_tree_mask + head.forward + draft_logits + topk) and `overhead` is level
minus the sum of the parts' medians (Python glue and dispatch between them; negative values
mean noise). Heads: the shipped EAGLE-2 head (draft vocabulary 8 192) and a random EAGLE-3
head with an 8 192-token draft vocabulary (same shapes as a trained one).

    PYTHONPATH=.:python OMP_NUM_THREADS=1 python benchmarks/profile_draft_step.py \
        --out benchmarks/results/draft_step_profile_cpu.json
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import specdec_kernels.ops as ops
from specdec import decode_path
from specdec.eagle import EagleHead, load_head
from specdec.heads import shipped_head_path
from specdec.loader import load_model
from specdec.model import AttentionMetadata

CONTEXT = 256  # committed positions in the head's cache
TOPK = 8


def parts(head, B, M):
    """-> {name: zero-argument callable} of one draft level's parts, plus "level"."""
    dev = head.fc.weight.device
    dtype = head.fc.weight.dtype
    cache = head.new_cache(B, CONTEXT + 64)
    slots = torch.arange(B, device=dev)
    cache.cache_lens[slots] = CONTEXT
    with torch.no_grad():
        cache.k.normal_()
        cache.v.normal_()
    base = cache.cache_lens[slots] - 1
    parents = torch.zeros(B, 1 + M, dtype=torch.int32, device=dev)
    parents[:, 0] = -1
    num = torch.full((B,), 1 + M, dtype=torch.int32, device=dev)
    tokens = torch.randint(0, head.args.vocab_size, (B, M), device=dev)
    feats = torch.randn(B, M, head.args.dim, dtype=dtype, device=dev)
    positions = (base + 1)[:, None].expand(B, M)
    mask, _ = ops.build_tree_mask(parents, num)
    lay, att = head.layer, head.layer.attention
    cos, sin = head._rope(positions)
    emb = head.target.tok_embeddings(tokens)
    if head.version < 3:
        x = head.fc(torch.cat((emb, feats), -1))
        attn_in = x
    else:
        x = feats
        attn_in = torch.cat((lay.attention_norm(emb), head.hidden_norm(x)), -1)
    meta = AttentionMetadata.verify(cache, slots, base, num, mask, 1, M)
    q, k, v = att.project(attn_in, cos, sin)
    o = att.attend(q, k, v, meta)
    h = x + att.wo(o.reshape(B, M, -1))
    out = h + lay.feed_forward(lay.ffn_norm(h))
    logits = head.draft_logits(out)

    def level():
        m, _ = ops.build_tree_mask(parents, num)
        hid = head(tokens, feats, cache, slots, base, 1, num, m, positions)
        lp, tok = torch.log_softmax(head.draft_logits(hid), -1).topk(TOPK, dim=-1)
        return head.draft_to_target(tok)

    p = {
        "tree_mask": lambda: ops.build_tree_mask(parents, num),
        "metadata": lambda: AttentionMetadata.verify(cache, slots, base, num, mask, 1, M),
        "embed_rope": lambda: (head.target.tok_embeddings(tokens), head._rope(positions)),
    }
    if head.version < 3:
        p["fc"] = lambda: head.fc(torch.cat((emb, feats), -1))
    else:
        p["input_norms"] = lambda: torch.cat((lay.attention_norm(emb), head.hidden_norm(x)), -1)
    p.update(
        {
            "qkv_proj": lambda: att.project(attn_in, cos, sin),
            "attention_op": lambda: att.attend(q, k, v, meta),
            "o_proj": lambda: x + att.wo(o.reshape(B, M, -1)),
            "mlp": lambda: h + lay.feed_forward(lay.ffn_norm(h)),
            "draft_lm_head": lambda: head.draft_logits(out),
            "topk": lambda: head.draft_to_target(
                torch.log_softmax(logits, -1).topk(TOPK, dim=-1)[1]
            ),
            "level": level,
        }
    )
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--nodes", default="8,16,32,48")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--decode-path",
        choices=("on", "off", "both"),
        default="both",
        help="the heads with specdec.decode_path configured (prepacked linears and layer ops, as "
        "the engine's drafter runs them), without, or both",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(dtype=dtype)

    def make_heads():
        return {
            "eagle2_shipped": load_head(shipped_head_path(), model),
            "eagle3_random": EagleHead.random(model, version=3, seed=0, draft_vocab_size=8192),
        }

    heads = {}
    if args.decode_path in ("off", "both"):  # the torch modules as written
        heads.update(make_heads())
    if args.decode_path in ("on", "both"):  # as the engine's drafter runs them
        for name, head in make_heads().items():
            decode_path.configure(head)
            heads[f"{name}+decode_path"] = head
    configs = [
        (name, B, M)
        for name in heads
        for B in map(int, args.batches.split(","))
        for M in map(int, args.nodes.split(","))
    ]
    with torch.no_grad():
        fns = {c: parts(heads[c[0]], c[1], c[2]) for c in configs}
        times = {c: {k: [] for k in fns[c]} for c in configs}
        for c in configs:  # warm-up
            for f in fns[c].values():
                f()
        for _ in range(args.reps):
            for c in configs:
                for k, f in fns[c].items():
                    t0 = time.perf_counter()
                    f()
                    times[c][k].append(time.perf_counter() - t0)
    rows = []
    for c in configs:
        med = {k: statistics.median(v) * 1e6 for k, v in times[c].items()}
        level = med.pop("level")
        row = {"head": c[0], "batch": c[1], "nodes": c[2], "level_us": round(level, 1)}
        row.update({f"{k}_us": round(v, 1) for k, v in med.items()})
        row["overhead_us"] = round(level - sum(med.values()), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": 1,
            "dtype": args.dtype,
            "context": CONTEXT,
            "topk": TOPK,
            "reps": args.reps,
            "decode_path": args.decode_path,
            "load_before": os.getloadavg(),
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

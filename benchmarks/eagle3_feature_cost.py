"""Storing vs recomputing EAGLE-3 features (issue 14): per training position, the cost of
reading them from a shard, of recomputing them by a teacher-forced target prefill (bf16,
float32), and of an EAGLE-3 train step at TTT 1 / 3 / 7, on 8 sequences of shards3.

    OMP_NUM_THREADS=1 PYTHONPATH=.:python python benchmarks/eagle3_feature_cost.py
"""

import os
import statistics
import time

import torch
from safetensors.torch import load_file

from specdec.apps.train import frequent_tokens, head_loss, load_shards, make_batch
from specdec.eagle import EagleHead, eagle3_feature_layers
from specdec.loader import load_model

torch.set_num_threads(1)
path = "/work/data/shards3/shard_00000.safetensors"
t0 = time.perf_counter()
load_file(path)
t_load = time.perf_counter() - t0
seqs = load_shards("/work/data/shards3", [path], "aux")[:8]
ntok = sum(len(t) for t, _, _ in seqs)
print("positions in batch", ntok, "shard load s", round(t_load, 3), "shard positions", 13463)
res = {}
for dt in (torch.bfloat16, torch.float32):
    model, _ = load_model(dtype=dt)
    layers = eagle3_feature_layers(model.args.n_layers)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for tok, _, _ in seqs:
            cache = model.new_cache(1, len(tok) + 1)
            model.prefill([tok], cache, torch.zeros(1, dtype=torch.long), layers)
        ts.append(time.perf_counter() - t0)
    res[f"recompute_{dt}"] = statistics.median(ts) / ntok * 1e6
model = model.float().requires_grad_(False)
vocab = frequent_tokens(seqs, 8192)
head = EagleHead.random(model, version=3, seed=0, draft_vocab_size=len(vocab)).float()
head.d2t.copy_(vocab - torch.arange(len(vocab)))
batch = make_batch(seqs)
for k in (1, 3, 7):
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss, *_ = head_loss(head, batch, vocab, 0.0, None, k)
        loss.backward()
        ts.append(time.perf_counter() - t0)
    res[f"train_step_ttt{k}"] = statistics.median(ts) / ntok * 1e6
res["disk_read"] = t_load / 13463 * 1e6
print({k: round(v, 1) for k, v in res.items()}, "us per position; load", os.getloadavg())

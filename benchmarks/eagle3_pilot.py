"""Pilot (a pipeline check, not a result): EAGLE-2 vs EAGLE-3 (TTT 1 / 3) on the first
SHARDS shards of /work/data/shards3, same data, steps and batch; held-out top-1 per draft
depth (teacher-forced, 3 TTT passes) of the last 8 sequences.

    OMP_NUM_THREADS=1 PYTHONPATH=.:python nice -n 19 python benchmarks/eagle3_pilot.py SHARDS EPOCHS
"""

import json
import os
import sys
import time

import torch

from specdec.apps.train import data_feature_layers, evaluate, load_shards, shard_paths, train_head
from specdec.eagle import load_head
from specdec.loader import load_model

torch.set_num_threads(1)
D = "/work/data/shards3"
paths = shard_paths(D)[: int(sys.argv[1])]
EPOCHS, BS, HOLD = float(sys.argv[2]), 4, 8
model, _ = load_model(dtype=torch.float32)
hid = load_shards(D, paths, "hidden")
aux = load_shards(D, paths, "aux")
layers = data_feature_layers(D)
variants = [
    ("eagle2_ttt1", 2, 1, 0.2, hid),
    ("eagle3_ttt1", 3, 1, 0.0, aux),
    ("eagle3_ttt3", 3, 3, 0.0, aux),
]
out = {
    "shards": len(paths),
    "train_seqs": len(hid) - HOLD,
    "held_out_seqs": HOLD,
    "epochs": EPOCHS,
    "batch_size": BS,
    "lr": 1e-3,
    "draft_vocab": 4096,
    "results": {},
}
for name, ver, ttt, noise, seqs in variants:
    t0 = time.time()
    d = f"/tmp/e3/pilot/{name}"
    log = train_head(
        model,
        seqs[:-HOLD],
        d,
        epochs=EPOCHS,
        batch_size=BS,
        lr=1e-3,
        noise=noise,
        draft_vocab=4096,
        save_dtype=torch.float32,
        progress=False,
        ttt_steps=ttt,
        version=ver,
        feature_layers=layers if ver == 3 else None,
    )
    head = load_head(d, model)
    val = evaluate(head, seqs[-HOLD:], 4, steps=3)
    steps = [r for r in log if "step" in r]
    out["results"][name] = {
        "steps": len(steps),
        "train_loss_first": steps[0]["loss"],
        "train_loss_last": steps[-1]["loss"],
        "held_out": val,
        "seconds": round(time.time() - t0),
    }
    print(name, out["results"][name], "load", os.getloadavg(), flush=True)
    with open("/tmp/e3/pilot/pilot.json", "w") as f:
        json.dump(out, f, indent=1)

"""Tensor parallelism (specdec.models.tensor_parallel): greedy float32 output over 2 gloo ranks
equals 1 rank.

The workers are this file run as a script, one process per rank with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), all scenarios in one launch (start-up dominates);
the CLI path runs once under torchrun itself. Every launch has a timeout: a hang (ranks whose
collectives no longer match) fails the test instead of blocking CI.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from specdec.drafters.eagle_head import EagleHead
from specdec.errors import InvalidRequestError
from specdec.models import tensor_parallel as tp
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams

from model_testing import (
    N_TOKENS,
    PROMPTS,
    oracle_head,
    same_distribution_pvalue,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")

WORLD = 2
TIMEOUT_S = 300  # generous for a loaded 2-core box; a healthy launch takes ~20 s


def contextual():
    """Full-strength random layers: any head / cache / reduction mistake changes the output."""
    return tiny_model(layer_scale=1.0, seed=1)


GREEDY = SamplingParams(max_new_tokens=20)
# name -> (model, drafter head (built from the whole model) or None, tree, batch size, params);
# batch 3 < 4 prompts: the last request joins a slot freed mid-run
SCENARIOS = {
    "plain-b1": (contextual, None, "chain:1", 1, GREEDY),
    "plain-b3": (contextual, None, "chain:1", 3, GREEDY),
    "eagle3-tree-b1": (
        contextual,
        lambda m: EagleHead.random(m, 3, seed=1),
        "dynamic:4,3,10",
        1,
        GREEDY,
    ),
    "eagle3-tree-b3": (
        contextual,
        lambda m: EagleHead.random(m, 3, seed=1),
        "dynamic:4,3,10",
        3,
        GREEDY,
    ),
    "oracle-chain-b3": (tiny_model, oracle_head, "chain:4", 3, GREEDY),
    # measured costs: every rank must time the same sizes and take the same decisions
    "oracle-adaptive-b3": (tiny_model, oracle_head, "adaptive", 3, GREEDY),
    # sampled drafts (draft_probs): the replicated drafters must stay in lockstep
    "oracle-sampled-b3": (
        tiny_model,
        oracle_head,
        "chain:3",
        3,
        SamplingParams(temperature=1.0, seed=7, max_new_tokens=20),
    ),
}


def decode(name: str, parallel: "tp.Parallel | None" = None) -> dict:
    """Runs scenario `name` (sharded over the group when parallel is given) -> its tokens, the
    cache's shape and every step's draft tokens."""
    make_model, make_head, tree, batch_size, params = SCENARIOS[name]
    model = make_model()
    head = make_head(model) if make_head else None
    sampler = None
    if parallel is not None:
        tp.shard_model(model, parallel.rank, parallel.world)
        sampler = tp.BroadcastSampler()
    eng = Engine(
        model, head=head, tree=tree, batch_size=batch_size, max_seq_len=96, sampler=sampler
    )
    drafts = []
    propose = eng.drafter.propose

    def recording(*args, **kw):
        d = propose(*args, **kw)
        drafts.append(d.tokens.tolist())
        return d

    eng.drafter.propose = recording
    results, _ = eng.generate([Request(p, params) for p in PROMPTS])
    return {
        "tokens": [r.token_ids for r in results],
        "cache_k": list(eng.cache.k.shape),
        "drafts": drafts,
    }


def sampled_model():
    return tiny_model(vocab_size=16, layer_scale=0.01, seed=3)  # test_engine's small_vocab_model


def first_tokens(model, head, tree, n=1200, **engine_kw) -> torch.Tensor:
    """[n, N_TOKENS] tokens of n seeded requests at temperature 1 (test_engine.first_tokens
    with fewer seeds: every prompt's prefill is a forward with its collectives here)."""
    eng = Engine(model, head=head, tree=tree, batch_size=200, max_seq_len=32, **engine_kw)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=N_TOKENS) for s in range(n)]
    results, _ = eng.generate([Request([1, 2, 3], p) for p in params])
    return torch.tensor([r.token_ids for r in results])


def sampled_first_tokens(parallel: "tp.Parallel") -> torch.Tensor:
    """Sampled oracle chain drafts (draft_probs) over the group."""
    model = sampled_model()
    head = oracle_head(model)
    tp.shard_model(model, parallel.rank, parallel.world)
    return first_tokens(model, head, "chain:3", sampler=tp.BroadcastSampler())


def worker(out_dir: str) -> None:
    """One rank: every scenario, then plain decoding with the all_reduce left out (broken)."""
    torch.set_num_threads(1)
    parallel = tp.init(int(os.environ["WORLD_SIZE"]))
    out = {name: decode(name, parallel) for name in SCENARIOS}
    reduce = tp.RowParallelLinear.forward
    tp.RowParallelLinear.forward = lambda self, x: torch.nn.functional.linear(x, self.weight)
    out["broken"] = decode("plain-b3", parallel)
    tp.RowParallelLinear.forward = reduce
    out["sampled-first-tokens"] = sampled_first_tokens(parallel).tolist()
    with open(os.path.join(out_dir, f"rank{parallel.rank}.json"), "w") as f:
        json.dump(out, f)
    tp.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, *sys.path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1")


def wait_all(procs, timeout=TIMEOUT_S) -> list:
    """-> [(returncode, output)]; on timeout kills every process group and fails."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"tensor-parallel run still going after {timeout} s (a hang?)")
    return outs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp")
    env = child_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(out_dir)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: killable as a whole
        )
        for r in range(WORLD)
    ]
    for rc, out in wait_all(procs):
        assert rc == 0, out[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "sampled" not in n])
def test_greedy_tp2_equals_tp1(ranks, name):
    one = decode(name)
    assert ranks[0][name]["tokens"] == one["tokens"]
    assert ranks[1][name]["tokens"] == one["tokens"]
    assert ranks[0][name]["drafts"] == ranks[1][name]["drafts"]  # the same trees on both ranks


def test_speculation_really_accepted(ranks):
    """The oracle head's drafts are accepted: fewer steps (proposals) than plain decoding of as
    many tokens (no EOS: every request makes its 20)."""
    assert len(ranks[0]["oracle-chain-b3"]["drafts"]) < len(ranks[0]["plain-b3"]["drafts"])


def test_sampled_drafts_agree_across_ranks(ranks):
    """Sampled drafting is replicated: both ranks drew the same drafts every step (the
    requests' generators in lockstep) and emitted the same tokens."""
    a, b = ranks[0]["oracle-sampled-b3"], ranks[1]["oracle-sampled-b3"]
    assert a["drafts"] == b["drafts"] and a["tokens"] == b["tokens"]
    assert all(len(t) == 20 for t in a["tokens"])


def test_sampled_tp2_follows_the_target(ranks):
    """Sampled speculative decoding over 2 ranks against plain decoding in one process: the
    two-sample test of test_engine (per position and the joint of the first two tokens)."""
    plain = first_tokens(sampled_model(), None, "chain:1")
    spec = torch.tensor(ranks[0]["sampled-first-tokens"])
    assert spec.shape == plain.shape
    assert same_distribution_pvalue(spec, plain) > 1e-3


def test_each_rank_caches_only_its_kv_heads(ranks):
    model = tiny_model()
    L, Hkv, D = model.args.n_layers, model.args.n_kv_heads, model.args.head_dim
    whole = decode("plain-b1")["cache_k"]
    assert whole[0] == L and whole[3:] == [Hkv, D]
    for r in ranks:
        assert r["plain-b1"]["cache_k"] == whole[:3] + [Hkv // WORLD, D]


def test_missing_all_reduce_is_detected(ranks):
    """The deliberately broken split (row-parallel outputs never summed) changes the output:
    the equality above can fail."""
    assert ranks[0]["broken"]["tokens"] != decode("plain-b3")["tokens"]


def test_shard_model_slices_heads_and_mlp():
    """In one process, no collective needed: rank 1 of 2 keeps query heads 2-3, KV head 1,
    and the second half of both the gate and the up projection."""
    model = tiny_model()
    a = model.args
    wqkv = model.layers[0].attention.wqkv.weight.clone()
    w13 = model.layers[0].feed_forward.w13.weight.clone()
    tp.shard_model(model, 1, 2)
    attn, mlp = model.layers[0].attention, model.layers[0].feed_forward
    D, H = a.head_dim, a.hidden_dim
    q, k, v = attn.wqkv.weight.split(attn.qkv_sizes)
    assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
    assert torch.equal(q, wqkv[2 * D : 4 * D])
    assert torch.equal(k, wqkv[4 * D + D : 4 * D + 2 * D])
    assert torch.equal(v, wqkv[6 * D + D : 6 * D + 2 * D])
    assert isinstance(attn.wo, tp.RowParallelLinear) and attn.wo.weight.shape == (a.dim, 2 * D)
    gate, up = mlp.w13.weight.chunk(2)
    assert torch.equal(gate, w13[H // 2 : H]) and torch.equal(up, w13[H + H // 2 :])
    assert mlp.w2.weight.shape == (a.dim, H // 2)
    assert model.new_cache(1, 16).k.shape[3] == 1
    with pytest.raises(InvalidRequestError, match="already split"):
        tp.shard_model(model, 1, 2)


def test_indivisible_heads_are_a_clear_error():
    model = tiny_model()  # 4 query heads, 2 KV heads, hidden_dim 64
    with pytest.raises(InvalidRequestError, match=r"--tp 3.*n_heads = 4, n_kv_heads = 2"):
        tp.shard_model(model, 0, 3)
    with pytest.raises(InvalidRequestError, match=r"2 not divisible by 4 \(--tp can be 1, 2\)"):
        tp.shard_model(model, 0, 4)
    assert model.layers[0].attention.n_heads == 4  # left whole


def test_init_without_torchrun_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InvalidRequestError, match="torchrun --nproc-per-node 2"):
        tp.init(2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InvalidRequestError, match="WORLD_SIZE is 3"):
        tp.init(2)


# ---------------------------------------------------------------------- the CLI under torchrun
def test_cli_tp2_under_torchrun_equals_tp1(tmp_path):
    from specdec.cli import main

    from model_testing import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "model")
    prompts = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": f"w{i} w{i + 3} w7"}) for i in range(3)]
    prompts.write_text("\n".join(lines) + "\n")
    # the tiny model has no shipped head: a seeded random EAGLE head, adaptive trees
    argv = [
        "generate",
        "--model",
        ckpt,
        "--prompts",
        str(prompts),
        "--no-chat-template",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--dtype",
        "float32",
    ]
    main([*argv, "--output", str(tmp_path / "tp1.jsonl")])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={WORLD}",
            "-m",
            "specdec",
            *argv,
            "--tp",
            str(WORLD),
            "--output",
            str(tmp_path / "tp2.jsonl"),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=tmp_path,  # `-m` puts the cwd first: not the checkout's sources (no built library)
    )
    [(rc, out)] = wait_all([proc])
    assert rc == 0, out[-3000:]
    assert out.count("tensor parallel over 2 ranks") == 1  # rank 0 alone reports

    def rows(name):  # written as requests finish: in id order here
        lines = (tmp_path / name).read_text().splitlines()
        return sorted((json.loads(line) for line in lines), key=lambda r: r["id"])

    one, two = rows("tp1.jsonl"), rows("tp2.jsonl")
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert all(len(r["token_ids"]) == 8 for r in two)


def test_cli_tp_without_torchrun_is_one_error_line(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    from model_testing import write_tiny_checkpoint

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ckpt = write_tiny_checkpoint(tmp_path / "model")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", ckpt, "--prompt", "w1 w2", "--tp", "2"])
    assert e.value.code == 2
    assert "launch with torchrun --nproc-per-node 2" in capsys.readouterr().err


if __name__ == "__main__":
    worker(sys.argv[1])

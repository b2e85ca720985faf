"""Tiny models, runs and statistics shared by the model, drafter, runtime and training tests
(the engine's float32 exactness tests all draw on them)."""

import json
import os
import types

import pytest
import torch
from scipy.stats import chi2_contingency

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead
from specdec.models.config import ModelArgs
from specdec.models.llama import Transformer
from specdec.runtime.engine import Engine
from specdec.runtime.requests import Request, SamplingParams
from specdec.speculation.cost_model import CostModel
from specdec.speculation.trees import BatchSampling
from specdec.training.data import generate_shards

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3]]


def sampling(temps, top_k=0, top_p=1.0, seed=0) -> BatchSampling:
    """A batch's sampling parameters: temps [B] (0 = greedy), one seeded generator per row."""
    B = len(temps)
    return BatchSampling(
        torch.tensor(temps, dtype=torch.float32),
        torch.full((B,), top_k, dtype=torch.int32),
        torch.full((B,), top_p),
        [torch.Generator().manual_seed(seed + b) for b in range(B)],
    )


def tiny_model(vocab_size=32, layer_scale=0.005, seed=0):
    """A random 3-layer model; layer_scale shrinks the layers' contribution to the residual
    stream, so the next token is mostly a function of the current one (predictable)."""
    args = ModelArgs(
        vocab_size=vocab_size,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 0.1))
        for layer in model.layers:
            layer.attention.wo.weight.mul_(layer_scale)
            layer.feed_forward.w2.weight.mul_(layer_scale)
    return model


def oracle_head(model):
    """EAGLE-2 head whose output is the embedding of its input token: fc = [I, 0], no
    attention / MLP contribution; the target's lm_head then scores it much like the target."""
    head = EagleHead.random(model, version=2, seed=0)
    dim = model.args.dim
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :dim] = torch.eye(dim)
        head.layer.attention.wo.weight.zero_()
        head.layer.feed_forward.w2.weight.zero_()
    return head


def run(model, head, tree, batch_size, params=None, prompts=PROMPTS, **kw):
    eng = Engine(model, head=head, tree=tree, batch_size=batch_size, max_seq_len=96, **kw)
    params = params or SamplingParams(max_new_tokens=24)
    results, stats = eng.generate([Request(p, params) for p in prompts])
    return [r.token_ids for r in results], stats


def bf16_run(tree, monkeypatch, **env):
    """Greedy tokens of a bf16 contextual tiny model with a random EAGLE-2 head, the engine run
    under the environment variables env -> (tokens, model, head)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = tiny_model(layer_scale=1.0, seed=1).to(torch.bfloat16)
    head = EagleHead.random(model, version=2, seed=0).to(torch.bfloat16)
    tokens, _ = run(model, head, tree, batch_size=2)
    return tokens, model, head


# ---------------------------------------------------------------------- distribution
N_SEEDS = 3000


N_TOKENS = 3


def first_tokens(model, head, tree, params, **engine_kw):
    """[N_SEEDS, N_TOKENS] generated tokens, one seeded request per row."""
    eng = Engine(model, head=head, tree=tree, batch_size=250, max_seq_len=32, **engine_kw)
    reqs = [
        Request([1, 2, 3], SamplingParams(**params, seed=s, max_new_tokens=N_TOKENS))
        for s in range(N_SEEDS)
    ]
    results, _ = eng.generate(reqs)
    return torch.tensor([r.token_ids for r in results])


def same_distribution_pvalue(a, b):
    """Smallest p-value of chi-square two-sample tests: per position, and for the joint of the
    first two tokens (cells with few samples pooled)."""
    pvals = []
    columns = [a[:, i] for i in range(N_TOKENS)], [b[:, i] for i in range(N_TOKENS)]
    columns[0].append(a[:, 0] * 1000 + a[:, 1])
    columns[1].append(b[:, 0] * 1000 + b[:, 1])
    for x, y in zip(*columns):
        cells = torch.cat((x, y)).unique()
        table = torch.stack([(x[:, None] == cells).sum(0), (y[:, None] == cells).sum(0)])
        big = table.sum(0) >= 10
        table = torch.cat((table[:, big], table[:, ~big].sum(1, keepdim=True)), 1)
        table = table[:, table.sum(0) > 0]
        pvals.append(chi2_contingency(table.numpy())[1])
    return min(pvals)


SAMPLING = {"t1": dict(temperature=1.0), "filtered": dict(temperature=0.7, top_k=6, top_p=0.9)}


# verifying a bigger tree costs little: speculation pays whenever drafts are accepted
CHEAP_VERIFY = CostModel(1, [1, 2, 4, 10], [1.0, 1.01, 1.02, 1.05], [0.02, 0.04, 0.06, 0.08])


# ---------------------------------------------------------------------- a tiny checkpoint
def write_tiny_checkpoint(path, vocab=64):
    """A random 2-layer Llama checkpoint dir with a word-level tokenizer (words w0 .. w61, no
    chat template, no EOS): the CLI loads it in a fraction of a second."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specdec.models.config import ModelArgs
    from specdec.models.loader import _required_weights

    os.makedirs(path, exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
    }
    args = ModelArgs.from_hf_config(config)
    rows = {
        "q_proj": 32,
        "k_proj": 16,
        "v_proj": 16,
        "o_proj": 32,
        "gate_proj": 64,
        "up_proj": 64,
        "down_proj": 32,
        "embed_tokens": vocab,
        "lm_head": vocab,
    }
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name in _required_weights(args):
        kind = name.split(".")[-2]
        if "norm" in kind:
            weights[name] = torch.ones(32)
        else:
            weights[name] = (
                torch.randn(rows[kind], 64 if kind == "down_proj" else 32, generator=gen) * 0.3
            )
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    words = ["<unk>", "<s>"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    return str(path)


# the trainer's tiny target and its self-distillation shards (module fixtures of the training
# and Medusa tests)
TRAIN_EOS = 0
TRAIN_PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19]]


@pytest.fixture(scope="module")
def target():
    args = ModelArgs(
        vocab_size=48,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5 if p.dim() > 1 else 0.1)
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shards"))
    generate_shards(
        target,
        types.SimpleNamespace(eos_token_ids={TRAIN_EOS}),
        TRAIN_PROMPTS,
        path,
        batch_size=3,
        max_new_tokens=12,
        progress=False,
    )
    return path


def always_accept(
    target_logits,
    draft_tokens,
    parents,
    num_nodes,
    draft_probs,
    temperature,
    top_k,
    top_p,
    uniforms,
):
    """A broken sampler: follows the first child down to a leaf, accepting every draft."""
    accepted, num_accepted, out = ops.tree_rejection_sample(
        target_logits,
        draft_tokens,
        parents,
        num_nodes,
        draft_probs,
        temperature,
        top_k,
        top_p,
        uniforms,
    )
    for b in range(parents.shape[0]):
        path = [0]
        while True:
            kids = [c for c in range(1, int(num_nodes[b])) if int(parents[b, c]) == path[-1]]
            if not kids:
                break
            path.append(kids[0])
        k = len(path)
        accepted[b, :k] = torch.tensor(path)
        out[b, : k - 1] = draft_tokens[b, path[1:]]
        out[b, k - 1] = int(target_logits[b, path[-1]].argmax())
        num_accepted[b] = k - 1
    return accepted, num_accepted, out

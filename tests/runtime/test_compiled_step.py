"""The compiled verify step (specdec.runtime.compiled_step): same outputs and same greedy
decoding as
the eager forward (float32, tiny models), the specdec ops inside one full graph, the switch.

Inductor compiles take seconds per shape even for the tiny model, so the tests compile few
shapes (one module-scoped model) and trace with the "eager" backend where inductor's code is
not what is tested."""

import pytest
import torch

import specdec_kernels.ops as ops
from specdec.drafters.eagle_head import EagleHead
from specdec.models.llama import Transformer
from specdec.runtime import compiled_step

from model_testing import run, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def trees(T=4):
    """Two requests, trees of 4 and 2 nodes (row 1 padded), different cache lengths."""
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]], dtype=torch.int32)[:, :T]
    num_nodes = torch.tensor([4, 2], dtype=torch.int32)
    tokens = torch.tensor([[3, 7, 1, 30], [5, 9, 0, 0]])[:, :T]
    mask, depth = ops.build_tree_mask(parents, num_nodes)
    return tokens, num_nodes, mask, depth


def filled_cache(model, lens=(5, 9)):
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(2, 32, block_size=4)
    # shuffled blocks (the block-table indirection), the same for every cache made here
    perm = torch.randperm(cache.block_table.numel(), generator=gen)
    cache.block_table.copy_(perm.view_as(cache.block_table))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.cache_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    return cache


def real_rows(cache, num_nodes):
    """The cache rows the real tree nodes were written to, [N, Hkv, D] per layer, k and v."""
    lens = cache.cache_lens.long()
    node = torch.arange(int(num_nodes.max()))[None]
    rows, _ = cache.rows(torch.arange(2), lens[:, None] + node, node < num_nodes[:, None])
    L = cache.k.shape[0]
    return (
        cache.k.view(L, -1, *cache.k.shape[3:])[:, rows],
        cache.v.view(L, -1, *cache.v.shape[3:])[:, rows],
    )


@pytest.fixture(scope="module")
def model():
    """Full-strength layers (a cache mistake changes the tokens); compiled once per shape for
    the whole module."""
    m = tiny_model(layer_scale=1.0, seed=1)
    yield m
    compiled_step.disable(m)


def test_compiled_outputs_match_eager(model):
    """Padded batch (trees of 4 and 2 nodes), feature layers: the outputs at real nodes and the
    K/V written match the eager forward. Not bitwise: inductor's fused RMSNorm / SwiGLU /
    RoPE round differently (measured max |diff| ~3e-5 on logits of magnitude ~10)."""
    tokens, num_nodes, mask, depth = trees()
    slots = torch.arange(2)
    eager_cache, compiled_cache = filled_cache(model), filled_cache(model)
    ref = model.eager_forward(tokens, eager_cache, slots, num_nodes, mask, depth, (0, 2))
    step = compiled_step.CompiledStep(model)
    out = step(tokens, compiled_cache, slots, num_nodes, mask, depth, (0, 2))
    ((key, seconds),) = step.compile_s.items()
    assert key[:3] == (2, 4, (0, 2)) and seconds > 0
    real = torch.arange(4)[None] < num_nodes[:, None]
    for name, a, b in zip(("logits", "hidden", "aux"), ref, out):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b[real], a[real], rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(out.logits[real].argmax(-1), ref.logits[real].argmax(-1))
    for a, b in zip(real_rows(eager_cache, num_nodes), real_rows(compiled_cache, num_nodes)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # nothing else written (padding included)
    torch.testing.assert_close(compiled_cache.k, eager_cache.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_cache.v, eager_cache.v, rtol=1e-4, atol=1e-4)


def test_fullgraph_holds_the_specdec_ops(model):
    """fullgraph=True traces the whole step, tree_verify and the cache write inside it."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    tokens, num_nodes, mask, depth = trees()
    step = compiled_step.CompiledStep(model, backend=record)
    step(tokens, filled_cache(model), torch.arange(2), num_nodes, mask, depth)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.specdec.tree_verify) == model.args.n_layers
    assert sum("write_kv" in str(t) for t in targets) == model.args.n_layers


def test_greedy_plain_and_eagle_identical_with_compile(model):
    """Greedy decoding through the compiled step reproduces eager decoding token for token:
    plain at batch 2 (4 prompts: the last two join freed slots) and EAGLE over dynamic trees
    at batch 1. Without freezing, to halve the compile time (test_compiled_outputs_match_eager
    covers it)."""
    head = EagleHead.random(model, version=2, seed=1)
    compiled_step.disable(model)
    plain, _ = run(model, None, "chain:1", 2)
    eagle, _ = run(model, head, "dynamic:3,2,5", 1)
    step = compiled_step.enable(model, freezing=False)
    try:
        assert run(model, None, "chain:1", 2)[0] == plain
        assert run(model, head, "dynamic:3,2,5", 1)[0] == eagle == plain[:1] + eagle[1:]
        assert {k[:2] for k in step.compile_s} == {(2, 1), (1, 8)}  # both compiled, T=5 bucketed
    finally:
        compiled_step.disable(model)


def test_broken_cache_write_is_detected(model, monkeypatch):
    """A compiled step that forgets to write the K/V changes greedy decoding: the exactness
    test above can fail."""
    plain, _ = run(model, None, "chain:1", 1, prompts=[[1, 2, 3]])
    monkeypatch.setattr(compiled_step, "write_kv", lambda *args: None)  # writes nothing
    compiled_step.enable(model, backend="eager")
    try:
        assert run(model, None, "chain:1", 1, prompts=[[1, 2, 3]])[0] != plain
    finally:
        compiled_step.disable(model)


def test_shapes_past_max_shapes_run_eagerly(model):
    tokens, num_nodes, mask, depth = trees()
    step = compiled_step.CompiledStep(model, max_shapes=0)
    cache_a, cache_b = filled_cache(model), filled_cache(model)
    out = step(tokens, cache_a, torch.arange(2), num_nodes, mask, depth)
    ref = model.eager_forward(tokens, cache_b, torch.arange(2), num_nodes, mask, depth)
    assert step.compile_s == {}
    assert torch.equal(out.logits, ref.logits)


@pytest.mark.parametrize(
    "env, dtype, expected",
    [
        (None, torch.float32, False),  # auto: off (compile time does not pay yet)
        ("auto", torch.bfloat16, False),
        ("0", torch.bfloat16, False),
        ("1", torch.float32, True),
    ],
)
def test_switch(monkeypatch, env, dtype, expected):
    if env is None:
        monkeypatch.delenv("SPECDEC_COMPILE", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_COMPILE", env)
    m = Transformer(tiny_model().args).to(dtype)
    assert compiled_step.wanted(m) is expected
    assert (compiled_step.configure(m) is not None) is expected
    # a decision stands for later Engines (configure(model) with no setting), unless overridden
    monkeypatch.setenv("SPECDEC_COMPILE", "0" if expected else "1")
    assert (compiled_step.configure(m) is not None) is expected
    assert (compiled_step.configure(m, not expected) is not None) is not expected


def test_more_shapes_than_dynamos_recompile_limit(model):
    """Every shape's graph shares dynamo's cache of one code object, whose recompile limit is 8:
    a ninth shape (batch sizes, engines with other cache sizes) must not fail under
    fullgraph=True."""
    step = compiled_step.CompiledStep(model, backend="eager", max_shapes=10)
    for B in range(1, 11):
        cache = model.new_cache(B, 16)
        root = torch.full((B, 1), -1, dtype=torch.int32)
        num_nodes = torch.ones(B, dtype=torch.int32)
        mask, depth = ops.build_tree_mask(root, num_nodes)
        step(torch.zeros(B, 1, dtype=torch.long), cache, torch.arange(B), num_nodes, mask, depth)
    assert len(step.compile_s) == 10


def test_configure_leaves_other_targets_eager():
    """Engine(target) calls configure on every target; one that is not specdec's Transformer
    (the transformers integration's HFTarget) has no compiled step and runs eagerly."""

    class OtherTarget(torch.nn.Module):
        pass

    assert compiled_step.configure(OtherTarget()) is None
    assert compiled_step.configure(OtherTarget(), setting=True) is None


def test_write_sources_send_padding_to_node_zero():
    """write_kv's sources: real nodes write themselves, padding rewrites its tree's node 0
    (same row, same values), so the write needs no data-dependent shape (CUDA graphs)."""
    sources = compiled_step.write_sources(torch.tensor([3, 1, 4], dtype=torch.int32), 4)
    assert sources.tolist() == [0, 1, 2, 0, 4, 4, 4, 4, 8, 9, 10, 11]


@pytest.mark.parametrize(
    "device, env, expected",
    [
        ("cpu", None, ("default", False)),
        ("cpu", "reduce-overhead", ("reduce-overhead", False)),  # no graphs of CPU tensors
        ("cuda", None, ("reduce-overhead", True)),  # gpt-fast's choice on GPUs
        ("cuda", "default", ("default", False)),
        ("cuda", "max-autotune-no-cudagraphs", ("max-autotune-no-cudagraphs", False)),
    ],
)
def test_compile_mode_per_device(monkeypatch, device, env, expected):
    if env is None:
        monkeypatch.delenv("SPECDEC_COMPILE_MODE", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_COMPILE_MODE", env)
    assert compiled_step.compile_mode(torch.device(device)) == expected
    assert compiled_step.compile_mode(torch.device(device), "default") == ("default", False)
    if device == "cpu":
        step = compiled_step.CompiledStep(tiny_model())
        assert (step.mode, step.cuda_graphs) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_step_decodes_like_eager():
    """On a GPU the compiled step runs as CUDA graphs ("reduce-overhead"): greedy decoding
    through the replays (plain at batch 2, EAGLE trees at batch 1) reproduces the eager
    engine token for token (float32), and each replay's outputs survive the next one."""
    m = tiny_model(layer_scale=1.0, seed=1).cuda()
    head = EagleHead.random(m, version=2, seed=1).cuda()
    compiled_step.disable(m)
    plain, _ = run(m, None, "chain:1", 2)
    eagle, _ = run(m, head, "dynamic:3,2,5", 1)
    step = compiled_step.enable(m)
    try:
        assert step.cuda_graphs
        assert run(m, None, "chain:1", 2)[0] == plain
        assert run(m, head, "dynamic:3,2,5", 1)[0] == eagle
        tokens, num_nodes, mask, depth = (t.cuda() for t in trees())
        cache = m.new_cache(2, 32, block_size=4)
        slots = torch.arange(2, device="cuda")
        first = step(tokens, cache, slots, num_nodes, mask, depth)
        kept = first.logits.clone()
        step(tokens.flip(1), cache, slots, num_nodes, mask, depth)
        assert torch.equal(first.logits, kept)
    finally:
        compiled_step.disable(m)


def test_write_kv_passes_opcheck_and_writes_real_nodes_only():
    """The cache write as an op (schema, fake, mutation declared: torch.library.opcheck), and
    its effect: two trees of 3 and 1 real nodes in T = 4 write exactly those 4 rows."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2, 6, 4, 2, 8, generator=gen)
    v_cache = torch.randn(2, 6, 4, 2, 8, generator=gen)
    rows = torch.tensor([5, 6, 7, 8, 16, 17, 18, 19])
    num_nodes = torch.tensor([3, 1], dtype=torch.int32)
    sources = compiled_step.write_sources(num_nodes, 4)
    k, v = torch.randn(8, 2, 8, generator=gen), torch.randn(8, 2, 8, generator=gen)
    torch.library.opcheck(
        compiled_step.write_kv, (k_cache.clone(), v_cache.clone(), 1, rows, sources, k, v)
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    real = torch.tensor([0, 1, 2, 4])
    ref_k[1].view(-1, 2, 8)[rows[real]] = k[real]
    ref_v[1].view(-1, 2, 8)[rows[real]] = v[real]
    compiled_step.write_kv(k_cache, v_cache, 1, rows, sources, k, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)

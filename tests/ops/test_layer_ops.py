"""The CPU decode path's layer ops (rms_norm, add_rms_norm, rope_qkv, silu_and_mul) against
their references: float64 accuracy, the eager model's roundings reproduced bit for bit in
bf16 / fp16, every ISA build the same, rows independent, strided inputs, bad inputs, fakes."""

import math

import pytest
import torch

from specdec_kernels import ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ISAS = ["avx512bf16", "avx512", "avx2", "baseline"]


def rope_tables(B, T, D, dtype, max_pos=4000):
    """cos, sin: [B, T, 1, D] as the model computes them (float32, rounded to dtype)."""
    pos = torch.randint(0, max_pos, (B, T))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]


def cases(dtype, rows=5, dim=200, heads=(3, 1), D=64):
    """Random inputs of each op (odd sizes: vector tails), poisoned nowhere: all finite."""
    x = torch.randn(2, rows, dim).to(dtype)
    residual = torch.randn(2, rows, dim).to(dtype)
    weight = (1 + 0.1 * torch.randn(dim)).to(dtype)
    Hq, Hkv = heads
    qkv = (3 * torch.randn(2, rows, (Hq + 2 * Hkv) * D)).to(dtype)
    cos, sin = rope_tables(2, rows, D, dtype)
    gate_up = (4 * torch.randn(2, rows, 2 * 150)).to(dtype)
    return {
        "rms_norm": (x, weight, 1e-5),
        "add_rms_norm": (x, residual, weight, 1e-6),
        "rope_qkv": (qkv, cos, sin, Hq, Hkv),
        "silu_and_mul": (gate_up,),
    }


def run(name, args, backend="cpp"):
    out = getattr(ops, name)(*args, backend=backend)
    return out if isinstance(out, tuple) else (out,)


def oracle(name, args):
    """The reference in float64 (called directly: the ops take the model dtypes only)."""
    out = getattr(reference, name)(
        *[a.double() if isinstance(a, torch.Tensor) else a for a in args]
    )
    return out if isinstance(out, tuple) else (out,)


def ulp(dtype):
    return {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul"])
def test_against_float64_and_same_dtype_reference(name, dtype):
    args = cases(dtype)[name]
    got = run(name, args)
    want64 = oracle(name, args)
    want = run(name, args, backend="reference")  # the eager model's own roundings
    for g, w64, w in zip(got, want64, want):
        assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous()
        scale = w64.abs().max().item()
        # a few roundings to the dtype (rope: three; rms_norm: two) on values of size `scale`
        assert (g.double() - w64).abs().max().item() <= 4 * ulp(dtype) * scale
        if dtype != torch.float32:
            # every intermediate rounded as the torch ops round it: bitwise, or an ulp where
            # exp / 1/sqrt differ from ATen's by an ulp of float before the rounding
            diff = (g.float() - w.float()).abs()
            assert (diff <= ulp(dtype) * w.float().abs()).all()
            assert (diff > 0).float().mean().item() <= 0.01
        else:
            assert torch.allclose(g, w, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_build_gives_the_same_bits(dtype, cpu_isa):
    inputs = cases(dtype, rows=3, dim=77)
    outs = {}
    for isa in ISAS:
        cpu_isa(isa)
        outs[isa] = {name: run(name, args) for name, args in inputs.items()}
    for isa in ISAS[1:]:
        for name in inputs:
            for a, b in zip(outs[ISAS[0]][name], outs[isa][name]):
                assert torch.equal(a, b), (name, isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent(dtype):
    """A row's result does not depend on the other rows of the call (a tree's node 0 gets the
    bits a plain decode step would), above and below the parallel grain."""
    for rows in (1, 7, 70):
        for name, args in cases(dtype, rows=rows).items():
            whole = run(name, args)
            for r in (0, rows - 1):
                one = [
                    a[:, r : r + 1] if isinstance(a, torch.Tensor) and a.dim() > 1 else a
                    for a in args
                ]
                for w, o in zip(whole, run(name, one)):
                    assert torch.equal(w[:, r : r + 1], o), (name, rows, r)


def test_strided_inputs():
    """Views (a slice of a wider tensor, a transposed batch) are read correctly."""
    dtype = torch.bfloat16
    wide = torch.randn(2, 5, 300).to(dtype)
    x = wide[..., 50:250]  # last dim contiguous, row stride 300
    w = torch.randn(200).to(dtype)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm(x.contiguous(), w, 1e-5))
    g = torch.randn(5, 2, 300).to(dtype).transpose(0, 1)
    assert torch.equal(ops.silu_and_mul(g), ops.silu_and_mul(g.contiguous()))
    qkv = torch.randn(2, 4, 2 * 5 * 16).to(dtype)[..., ::2]  # last dim strided too
    cos, sin = rope_tables(2, 4, 16, dtype)
    for a, b in zip(
        ops.rope_qkv(qkv, cos, sin, 3, 1), ops.rope_qkv(qkv.contiguous(), cos, sin, 3, 1)
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_extremes(dtype):
    """exp's range ends: silu(g) -> g for large g, -> -0 for very negative g; inf / nan as
    the reference."""
    finfo_max = torch.finfo(dtype).max
    g = torch.tensor(
        [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            20.0,
            -20.0,
            87.5,
            -87.5,
            88.8,
            -88.8,
            100.0,
            -100.0,
            min(1e4, finfo_max),
            -min(1e4, finfo_max),
            math.inf,
            -math.inf,
            math.nan,
        ]
    )
    x = torch.cat([g, torch.full_like(g, 1.5)]).to(dtype)[None]
    got = ops.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.allclose(got[fin].float(), want[fin].float(), rtol=2 * ulp(dtype), atol=0)


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        ops.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.rms_norm(x.double(), torch.ones(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="residual must have the shape of x"):
        ops.add_rms_norm(x, x[:, :2], torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="x.size\\(-1\\) must be even"):
        ops.silu_and_mul(torch.randn(3, 7))
    cos, sin = rope_tables(2, 3, 16, torch.float32)
    with pytest.raises(RuntimeError, match="times an even head dim"):
        ops.rope_qkv(torch.randn(2, 3, 5 * 16 + 1), cos, sin, 3, 1)
    with pytest.raises(RuntimeError, match="num_q_heads and num_kv_heads must be >= 1"):
        ops.rope_qkv(torch.randn(2, 3, 5 * 16), cos, sin, 0, 1)
    with pytest.raises(RuntimeError, match="cos must have shape"):
        ops.rope_qkv(torch.randn(2, 3, 5 * 16), cos[:1], sin, 3, 1)
    with pytest.raises(RuntimeError, match="sin must have the dtype of qkv"):
        ops.rope_qkv(torch.randn(2, 3, 5 * 16), cos, sin.half(), 3, 1)
    # the reference backend is validated by the same C++ checks
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(7), 1e-5, backend="reference")
    with pytest.raises(NotImplementedError, match="no Triton kernel"):
        ops.rms_norm(x, torch.ones(8), 1e-5, backend="triton")


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul"])
def test_opcheck(name):
    """Schema, fake (meta) kernel and autograd registration agree with the CPU kernel, so the
    ops can sit inside torch.compile graphs."""
    args = cases(torch.bfloat16, rows=3, dim=40)[name]
    torch.library.opcheck(getattr(torch.ops.specdec, name), args)

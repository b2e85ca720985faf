"""torch.ops.specdec.tiled_linear (a bf16 product over the weight's tiles) and
pack_linear_tiles: float64 accuracy to float32 accumulation error, every row group and padded
last tile, rows independent of each other and of the thread count, every ISA build the same
bits, strided inputs, non-finite values carried, bad inputs named, the fake."""

import pytest
import torch

from specdec_kernels import ops, reference

ISAS = ["avx512bf16", "avx512", "avx2", "baseline"]
U32 = 2.0**-24  # float32 unit roundoff


def rand_bf16(*shape, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def case(rows, out_features, in_features, bias=True, seed=0, batch=()):
    gen = torch.Generator().manual_seed(seed)
    weight = rand_bf16(out_features, in_features, gen=gen, scale=in_features**-0.5)
    x = rand_bf16(*batch, rows, in_features, gen=gen)
    b = rand_bf16(out_features, gen=gen) if bias else None
    return x, weight, b


def assert_within_float32_sums(got, x, weight, bias):
    """|got - float64| <= one bf16 rounding of the result + float32 summation error."""
    ref = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = 2.0**-8 * ref.abs() + (x.shape[-1] + 2) * U32 * magnitude * (1 + 2.0**-7)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13])
@pytest.mark.parametrize("shape", [(64, 32), (160, 96), (5, 2), (200, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_against_float64(rows, shape, bias):
    """Every row group (1-6 rows share a pass; 7, 12, 13: several groups) and padded last
    tiles (160 = 2.5 tiles, 5 < 1 tile, 200), odd pair counts (130 / 2 = 65)."""
    x, weight, b = case(rows, *shape, bias=bias)
    tiles = ops.pack_linear_tiles(weight)
    assert_within_float32_sums(ops.tiled_linear(x, tiles, shape[0], b), x, weight, b)
    ref = ops.tiled_linear(x, tiles, shape[0], b, backend="reference")
    assert torch.equal(ref, reference.tiled_linear(x, tiles, shape[0], b))
    assert_within_float32_sums(ref, x, weight, b)


def test_pack_layout_and_roundtrip():
    weight = torch.arange(100 * 6, dtype=torch.float32).view(100, 6).to(torch.bfloat16)
    tiles = ops.pack_linear_tiles(weight)
    assert tiles.shape == (2, 3, 64, 2) and tiles.is_contiguous()
    assert tiles[1, 2, 3, 1] == weight[64 + 3, 2 * 2 + 1]
    assert (tiles[1, :, 36:] == 0).all()  # rows 100..127: padding
    assert torch.equal(reference.unpack_linear_tiles(tiles, 100), weight)
    with pytest.raises(ValueError, match="even in_features"):
        ops.pack_linear_tiles(weight[:, :5])


def test_rows_independent_batch_dims_and_threads():
    """A row's result is bitwise what it gives alone, in any batch shape, at any thread count
    (a tree's node the same as a plain step's token)."""
    x, weight, b = case(9, 200, 96, batch=(2,))
    tiles = ops.pack_linear_tiles(weight)
    got = ops.tiled_linear(x, tiles, 200, b)
    assert got.shape == (2, 9, 200)
    flat = x.reshape(-1, 96)
    alone = torch.cat([ops.tiled_linear(flat[r : r + 1], tiles, 200, b) for r in range(18)])
    assert torch.equal(got.reshape(-1, 200), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ops.tiled_linear(x, tiles, 200, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, single)


@pytest.mark.parametrize("out_features", [576, 570, 200])
def test_split_between_threads_gives_the_same_bits(out_features):
    """Weights large enough to split over threads (570 and 200: a partial last tile): bitwise
    one thread's result, and within float32 sums of float64."""
    x, weight, b = case(7, out_features, 1536)
    tiles = ops.pack_linear_tiles(weight)
    threads = torch.get_num_threads()
    try:
        outs = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs[n] = ops.tiled_linear(x, tiles, out_features, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])
    assert_within_float32_sums(outs[2], x, weight, b)


def test_every_isa_build_gives_the_same_bits(cpu_isa):
    x, weight, b = case(7, 160, 130)
    tiles = ops.pack_linear_tiles(weight)
    outs = {}
    for isa in ISAS:
        cpu_isa(isa)
        outs[isa] = ops.tiled_linear(x, tiles, 160, b)
    for isa in ISAS[1:]:
        assert torch.equal(outs[ISAS[0]], outs[isa]), isa


def test_strided_x_and_no_rows():
    x, weight, b = case(6, 64, 48)
    tiles = ops.pack_linear_tiles(weight)
    wide = torch.randn(6, 96).to(torch.bfloat16)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(ops.tiled_linear(strided, tiles, 64, b), ops.tiled_linear(x, tiles, 64, b))
    empty = ops.tiled_linear(x[:0], tiles, 64, b)
    assert empty.shape == (0, 64)


def test_non_finite_values_are_carried():
    x, weight, _ = case(2, 64, 32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    weight[7] = 0  # inf * 0: NaN, as float64 gives
    got = ops.tiled_linear(x, ops.pack_linear_tiles(weight), 64)
    want = torch.nn.functional.linear(x.double(), weight.double())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())


def bad_cases():
    x, weight, b = case(3, 100, 48)
    tiles = ops.pack_linear_tiles(weight)
    yield "x must be bfloat16", (x.float(), tiles, 100, b)
    yield "x must be \\[..., in_features\\]", (x[0, 0], tiles, 100, b)
    yield (
        "weight_tiles must be the tiles of a \\[100, 50\\]",
        (
            torch.randn(3, 50).to(torch.bfloat16),
            tiles,
            100,
            b,
        ),
    )
    yield "weight_tiles must be the tiles of a \\[200, 48\\]", (x, tiles, 200, None)
    yield "weight_tiles must be the tiles", (x, tiles[..., :1], 100, b)
    yield "weight_tiles \\(tiles\\) must be bfloat16", (x, tiles.float(), 100, b)
    yield (
        "weight_tiles \\(tiles\\) must be contiguous",
        (
            x,
            tiles.transpose(0, 1).contiguous().transpose(0, 1),
            100,
            b,
        ),
    )
    yield "weight_tiles \\(tiles\\) needs an even in_features", (x[..., :47], tiles, 100, b)
    yield "out_features must be >= 0", (x, tiles, -1, b)
    yield "bias must have shape \\[out_features\\] = \\[100\\]", (x, tiles, 100, b[:-1])
    yield "bias must be bfloat16", (x, tiles, 100, b.float())


@pytest.mark.parametrize("message,args", list(bad_cases()), ids=lambda v: str(v)[:30])
def test_bad_inputs_name_the_argument(message, args):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.tiled_linear(*args)
    with pytest.raises(RuntimeError, match=message):  # the reference runs the same checks
        ops.tiled_linear(*args, backend="reference")


def test_opcheck_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight, b = case(3, 100, 48, batch=(2,))
    tiles = ops.pack_linear_tiles(weight)
    torch.library.opcheck(torch.ops.specdec.tiled_linear, (x, tiles, 100, b))
    torch.library.opcheck(torch.ops.specdec.tiled_linear, (x, tiles, 100))
    with FakeTensorMode() as mode:
        out = torch.ops.specdec.tiled_linear(
            mode.from_tensor(x), mode.from_tensor(tiles), 100, mode.from_tensor(b)
        )
    assert out.shape == (2, 3, 100) and out.dtype == torch.bfloat16


def test_compiles_fullgraph():
    x, weight, b = case(2, 64, 32)
    tiles = ops.pack_linear_tiles(weight)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return torch.ops.specdec.tiled_linear(x, tiles, 64, b) * 2

    assert torch.equal(f(x), ops.tiled_linear(x, tiles, 64, b) * 2)

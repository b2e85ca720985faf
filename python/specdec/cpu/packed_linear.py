"""Weights laid out for decode: the model's bf16 linear layers run over copies of their
weights laid out once ("prepacked"), instead of F.linear, which reorders the weight on every
call. Two layouts, each made on first use:

  * tiles (specdec_kernels.ops.pack_linear_tiles, torch.ops.specdec.tiled_linear) for products of
    up to tiled_rows() rows: one front-to-back stream over the weight, 16 outputs x 2 inputs
    per 64-byte load, up to 6 rows per pass (csrc/cpu/tiled_linear.cpp);
  * oneDNN's blocked layout (mkldnn._reorder_linear_weight) for wider products.

At decode sizes (M = 1..64 rows) a CPU forward is a stream over the weights. Measured
(docs/cpu-decode-path.md): on an Intel Xeon with AMX the 121 linears of a
SmolLM2-135M step take ~36 ms per token through F.linear and ~26 ms prepacked in oneDNN, whose
AMX kernels win from M = 2; on an AMD EPYC without AMX oneDNN streams ~10-16 GB/s
at M = 1 and the tiles ~21-25 GB/s: 1.5-2.4x at 1-6 rows, 1.05x at 64, even at 128. oneDNN's
results are bitwise those of F.linear up to M = 32; the tiles' are float32 sums in another
order (within bf16 rounding of them), the same for a row whatever the other rows.

`configure(module)` turns every plain nn.Linear of a module (not subclasses with a forward of
their own, such as tp.RowParallelLinear) into a PackedLinear in place (the class is switched:
parameters, state_dict keys, isinstance(nn.Linear) and training are unchanged)
when it pays: CPU, bfloat16 weights, oneDNN with bf16 support, SPECDEC_PREPACK_WEIGHTS not 0.
The packed copy is an extra copy of the weights (the original stays for training, state_dict,
tensor-parallel slicing); a weight changed in place is repacked at its next call. The tiles,
streamed whole every step, live in 2 MB pages where the OS has them (specdec.cpu.host_memory,
SPECDEC_HUGE_PAGES: a step 0.88-0.99x the time from 4 KB pages).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec import envs
from specdec.cpu import host_memory
from specdec.device_memory import free_memory
from specdec_kernels import envs as kernel_envs
from specdec_kernels import ops


@functools.cache  # a dispatcher call: WeightPack.get asks on every wide product
def _supported() -> bool:
    """Whether torch's oneDNN has bf16 products on this CPU."""
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# SPECDEC_TILED_ROWS=auto on CPUs whose widest kernel build is AVX2 (no AVX-512) and whose
# oneDNN has no bf16: every product. ATen's bf16 product there runs row by row (a step's
# 269 MB of weights 26 ms at 1 row, 41 at 2, 145 at 8, 2418 at 128 on a 2-core Zen 3), the
# tiles stream them (22, 22, 35, 515 ms; docs/cpu-decode-path.md)
AVX2_TILED_ROWS = 1 << 62


@functools.cache
def _auto_tiled_rows(isa_cap: str | None) -> int:
    """SPECDEC_TILED_ROWS=auto for this CPU (see specdec/envs.py)."""
    capability: dict = getattr(torch._C._cpu, "_get_cpu_capability", dict)()
    if capability.get("avx512_bf16") and isa_cap in (None, "", "amx", "avx512bf16"):
        return 1 if capability.get("amx_bf16") else 64
    if (
        capability.get("avx2")
        and not capability.get("avx512_f")
        and isa_cap in (None, "", "avx2")
        and not _supported()
    ):
        return AVX2_TILED_ROWS
    return 0  # the tiles' other builds are unmeasured against oneDNN


def tiled_rows() -> int:
    """Most rows of a product that takes the tiles (SPECDEC_TILED_ROWS; 0: never)."""
    setting = envs.SPECDEC_TILED_ROWS
    return _auto_tiled_rows(kernel_envs.SPECDEC_CPU_ISA) if setting == "auto" else int(setting)


def packs() -> bool:
    """Whether this CPU has a packed bf16 layout that pays: oneDNN's, or the tiles."""
    return _supported() or tiled_rows() > 0


def uses_tiles(rows: int, in_features: int) -> bool:
    """Whether a product of `rows` rows over an [out, in_features] weight takes its tiles."""
    return rows <= tiled_rows() and in_features % 2 == 0


class WeightPack:
    """Copies of one bf16 weight [out_features, in_features] laid out for decode (tiles for
    few rows, oneDNN's for more), each made on first use and all dropped whenever the weight
    changes (new storage, or an in-place change)."""

    def __init__(self) -> None:
        self._packed: dict[str, Tensor] = {}  # "tiles" / "onednn" -> the copy
        self._key: tuple = ()  # (data_ptr, version) of the weight they were made from

    def get(self, weight: Tensor, x: Tensor) -> Tensor | None:
        """The copy of weight a product with x should take (bf16 on CPU, no autograd, not
        under torch.compile): tiles (4-D) or oneDNN's (2-D), else None."""
        if (
            weight.dtype != torch.bfloat16
            or x.dtype != torch.bfloat16
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            or torch.compiler.is_compiling()
        ):
            return None
        # a new tensor (load_state_dict's copy_ bumps the version; a new dtype, device or
        # shape is new storage) or an in-place change: repack
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._packed, self._key = {}, key
        rows = x.numel() // max(x.shape[-1], 1)
        layout = "tiles" if uses_tiles(rows, weight.shape[1]) else "onednn"
        if layout == "onednn" and not _supported():  # wider than the tiles take: F.linear
            return None
        packed = self._packed.get(layout)
        if packed is None:
            if layout == "tiles":  # streamed whole every step: in 2 MB pages (host_memory)
                packed = host_memory.streamed(ops.pack_linear_tiles(weight.detach()))
            else:  # batch-size hint 1: as good as the exact M for M = 1..512
                # (docs/cpu-decode-path.md)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self._packed[layout] = packed
        return packed

    def product(self, weight: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor | None:
        """x: [..., in_features] @ weight^T (+ bias) over its copy (see get), else None."""
        packed = self.get(weight, x)
        return None if packed is None else packed_product(x, packed, bias, weight.shape[0])


def packed_product(
    x: Tensor, packed: Tensor, bias: Tensor | None = None, out_features: int | None = None
) -> Tensor:
    """x: [..., in_features] @ a WeightPack's copy of an [out_features, in_features] weight
    (+ bias) -> [..., out_features]. out_features: needed for tiles (they pad the outputs)."""
    bias = None if bias is None else bias.detach()
    if packed.dim() == 4 and not packed.is_mkldnn:
        if out_features is None:
            raise ValueError("packed_product over tiles needs out_features")
        return torch.ops.specdec.tiled_linear(x, packed, out_features, bias)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


class PackedLinear(nn.Linear):
    """nn.Linear whose inference forward reads a oneDNN-prepacked copy of its bf16 weight.

    Gradients (a weight that requires grad under grad mode), torch.compile tracing and any
    other dtype or device take F.linear, so the module stays a drop-in nn.Linear."""

    _pack: WeightPack

    @classmethod
    def convert(cls, linear: nn.Linear) -> "PackedLinear":
        """linear, switched to this class in place (its parameters untouched)."""
        linear.__class__ = cls
        assert isinstance(linear, PackedLinear)
        linear._pack = WeightPack()
        return linear

    def unpack(self) -> nn.Linear:
        """Back to a plain nn.Linear, in place."""
        del self._pack
        self.__class__ = nn.Linear  # type: ignore[assignment]
        return self

    def packed_weight(self, x: Tensor) -> Tensor | None:
        """The prepacked copy (tiles or oneDNN's; made now if the weight changed) forward(x)
        takes, else None."""
        return self._pack.get(self.weight, x)

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        y = self._pack.product(self.weight, x, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


def prepare(module: nn.Module) -> int:
    """Makes now the copies module's PackedLinears will take in the engine's steps (the tiles
    for a decode step's few rows, oneDNN's layout for a prompt's many where it has bf16),
    instead of at the first forward that needs each: a request must not pay them in its
    time to first token -> how many copies were made (0: none needed or already made)."""
    linears = [m for m in module.modules() if isinstance(m, PackedLinear)]
    wide = tiled_rows() + 1
    made = 0
    with torch.no_grad():
        for m in linears:
            before = len(m._pack._packed)
            for rows in (1, wide) if wide <= 1 << 16 else (1,):
                m.packed_weight(m.weight.new_empty(rows, m.in_features))
            made += len(m._pack._packed) - before
    return made


_PLAIN = (nn.Linear, PackedLinear)


def _plain_linears(module: nn.Module) -> list[nn.Linear]:
    """module's nn.Linear modules, and PackedLinear ones, but no other subclass: a subclass with
    its own forward (tp.RowParallelLinear's all_reduce) must keep it."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and type(m) in _PLAIN]


def wanted(module: nn.Module, setting: bool | str | None = None) -> bool:
    """Whether module's linears should be prepacked. setting: True / False, or None / "auto":
    SPECDEC_PREPACK_WEIGHTS ("auto" when unset): on for bf16 weights on a CPU whose oneDNN
    supports bf16 or whose products take the tiles (tiled_rows() > 0), when the packed copies
    take at most half the memory still available."""
    if setting is None:
        setting = envs.SPECDEC_PREPACK_WEIGHTS
    if setting is False or not packs():
        return False
    weights = [m.weight for m in _plain_linears(module)]
    if not weights or any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in weights):
        return False
    if setting == "auto":  # the packed copies must not crowd out the KV caches
        copies = (tiled_rows() > 0) + _supported()  # tiles and / or oneDNN's
        copy_bytes = copies * sum({w.data_ptr(): w.nbytes for w in weights}.values())
        free = free_memory(torch.device("cpu"))
        return free is None or copy_bytes <= free // 2
    return True


def configure(module: nn.Module, setting: bool | str | None = None) -> int:
    """Prepacks module's linears if `wanted` (else unpacks any packed ones) -> how many are
    packed. Idempotent."""
    linears = _plain_linears(module)
    if not wanted(module, setting):
        for m in linears:
            if isinstance(m, PackedLinear):
                m.unpack()
        return 0
    for m in linears:
        if not isinstance(m, PackedLinear):
            PackedLinear.convert(m)
    return len(linears)

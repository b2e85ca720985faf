"""Weights laid out for decode: the model's bf16 linear layers run through oneDNN with their
weights reordered once ("prepacked") into its blocked layout, instead of F.linear, which
reorders the weight on every call.

At decode sizes (M = 1..64 rows) a CPU forward is a stream over the weights; F.linear in bf16
spends much of each call re-laying out the weight. Measured on this project's CPU (AVX512-BF16,
AMX; benchmarks/RESULTS.md, session 6): all 30 layers' projections of SmolLM2-135M plus its
49 152-row lm_head take ~36 ms per token through F.linear, ~26 ms prepacked, ~24 ms with a
hand-written AVX512-BF16 GEMV (vdpbf16ps) at M = 1, which loses from M = 2 (AMX tiles win);
so prepacked oneDNN is what runs. Results are bitwise those of F.linear up to M = 32 (the same
oneDNN kernels, float32 accumulation), within bf16 rounding above.

`configure(module)` turns every plain nn.Linear of a module (not subclasses with a forward of
their own, such as tp.RowParallelLinear) into a PackedLinear in place (the class is switched:
parameters, state_dict keys, isinstance(nn.Linear) and training are unchanged)
when it pays: CPU, bfloat16 weights, oneDNN with bf16 support, SPECDEC_PREPACK_WEIGHTS not 0.
The packed copy is an extra copy of the weights (the original stays for training, state_dict,
tensor-parallel slicing); a weight changed in place is repacked at its next call.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_kernels import envs

from .device_memory import free_memory


def _supported() -> bool:
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class WeightPack:
    """A oneDNN-prepacked copy of one bf16 weight [out_features, in_features], packed on first
    use and again whenever the weight changes (new storage, or an in-place change)."""

    def __init__(self) -> None:
        self._packed: Tensor | None = None
        self._key: tuple = ()  # (data_ptr, version) of the weight it was packed from

    def get(self, weight: Tensor, x: Tensor) -> Tensor | None:
        """The packed copy of weight when a product with x should take it (bf16 on CPU, no
        autograd, not under torch.compile), else None."""
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
        if self._packed is None or key != self._key:
            # batch-size hint 1: measured as good as the exact M for M = 1..512 (RESULTS.md)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self._key = key
        return self._packed


def packed_product(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: [..., in_features] @ a WeightPack's packed weight (+ bias) -> [..., out_features]."""
    bias = None if bias is None else bias.detach()
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
        """The prepacked weight (packed now if the weight changed) when forward(x) takes the
        packed path, else None."""
        return self._pack.get(self.weight, x)

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        packed = self.packed_weight(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_product(x, packed, self.bias)


_PLAIN = (nn.Linear, PackedLinear)


def _plain_linears(module: nn.Module) -> list[nn.Linear]:
    """module's nn.Linear modules, and PackedLinear ones, but no other subclass: a subclass with
    its own forward (tp.RowParallelLinear's all_reduce) must keep it."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and type(m) in _PLAIN]


def wanted(module: nn.Module, setting: bool | str | None = None) -> bool:
    """Whether module's linears should be prepacked. setting: True / False, or None / "auto":
    SPECDEC_PREPACK_WEIGHTS ("auto" when unset): on for bf16 weights on a CPU whose oneDNN
    supports bf16, when the packed copy takes at most half the memory still available."""
    if setting is None:
        setting = envs.SPECDEC_PREPACK_WEIGHTS
    if setting is False or not _supported():
        return False
    weights = [m.weight for m in _plain_linears(module)]
    if not weights or any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in weights):
        return False
    if setting == "auto":  # the packed copy must not crowd out the KV caches
        copy_bytes = sum({w.data_ptr(): w.nbytes for w in weights}.values())
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

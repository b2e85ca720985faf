"""The C++ layer ops on the CPU decode path: RMSNorm, residual add + RMSNorm, RoPE of the
fused q/k/v projection and SwiGLU of a model's blocks as one op each
(torch.ops.specdec.rms_norm / add_rms_norm / rope_qkv / silu_and_mul, csrc/cpu/layer_ops.cpp)
instead of the 5-15 small torch ops of the eager modules; and a verify step's whole block as
one C++ call (torch.ops.specdec.decode_layer, csrc/cpu/decode_layer.cpp: the same kernels back
to back, without the ~12 Python-level calls between them), and a Transformer's blocks as one
decode_layers call (the loop over the blocks in C++).

At decode sizes those small ops cost their dispatch, not their arithmetic. `configure(module)`
switches every RMSNorm, Attention and FeedForward of a module (the target, an EAGLE head) to
the ops when it pays: CPU, bfloat16 / float16 weights, SPECDEC_LAYER_OPS not 0. float32 (the
exactness contract's dtype) keeps the torch ops, which the references are; the ops round as
they do, so bf16 outputs match the eager model's but for an ulp of exp / rsqrt. Training and
torch.compile always take the torch ops (specdec.models.llama.use_layer_ops).
"""

import torch
from torch import nn

from specdec import envs
from specdec.cpu import fused_layers
from specdec.models.llama import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock

_MODULES = (RMSNorm, Attention, FeedForward, TransformerBlock)


def wanted(module: nn.Module, setting: bool | str | None = None) -> bool:
    """setting: True / False, or None / "auto": SPECDEC_LAYER_OPS ("auto" when unset): on
    for CPU bf16 / fp16 weights."""
    if setting is None:
        setting = envs.SPECDEC_LAYER_OPS
    if setting is False:
        return False
    params = list(module.parameters())
    return bool(params) and all(
        p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16) for p in params
    )


def configure(
    module: nn.Module,
    setting: bool | str | None = None,
    decode_layer: bool = True,
    decode_layers: bool = True,
) -> int:
    """Switches the layer ops of module's blocks on if `wanted` (else off) -> how many modules
    use them. decode_layer: whether a verify step's TransformerBlock then runs as one
    torch.ops.specdec.decode_layer call (the same kernels as its modules, from C++);
    decode_layers: whether a Transformer's blocks then run as one decode_layers call (else one
    decode_layer call each). Both off only to measure what they save. Idempotent."""
    on = wanted(module, setting)
    parts = [m for m in module.modules() if isinstance(m, _MODULES)]
    for m in parts:
        m.layer_ops = on and (decode_layer or not isinstance(m, TransformerBlock))
    for sub in module.modules():  # the whole-block calls' hooks (specdec.cpu.fused_layers)
        if isinstance(sub, TransformerBlock):
            sub.fused_forward = fused_layers.block_forward if on else None
        if isinstance(sub, Transformer):
            sub.fused_layers = fused_layers.layers_forward if on and decode_layers else None
    return len(parts) if on else 0

"""The CPU decode path of a module that runs for inference (the target, an EAGLE head, the
data stage's generator), docs/cpu-decode-path.md: prepacked bf16 linears
(specdec.cpu.packed_linear, SPECDEC_PREPACK_WEIGHTS), the C++ layer ops (specdec.cpu.layer_ops,
SPECDEC_LAYER_OPS) and each verify step's blocks as single C++ calls
(specdec.cpu.fused_layers). Each part decides for itself whether it pays (bf16 / fp16 weights
on a CPU); float32 and other devices keep the torch modules.

`configure(module)` is the one switch: the engine, the trainer's data stage and the
benchmarks call it (the benchmarks with explicit settings, to measure each part).
"""

from torch import nn

from specdec.cpu import layer_ops, packed_linear
from specdec.cpu.fused_layers import modules_unchanged

__all__ = ["configure", "modules_unchanged", "prepare"]


def configure(
    module: nn.Module,
    *,
    prepack: bool | str | None = None,
    layer_ops_setting: bool | str | None = None,
    decode_layer: bool = True,
    decode_layers: bool = True,
) -> None:
    """Switches module's CPU decode path on or off. prepack, layer_ops_setting: True / False,
    "auto", or None for the environment's setting (SPECDEC_PREPACK_WEIGHTS, SPECDEC_LAYER_OPS;
    "auto" when unset: on where it pays). decode_layer: a verify step's block as one
    decode_layer call; decode_layers: a Transformer's blocks as one decode_layers call (both
    off only to measure what they save). How many rows take the tiles is SPECDEC_TILED_ROWS.
    Idempotent."""
    packed_linear.configure(module, prepack)
    layer_ops.configure(
        module, layer_ops_setting, decode_layer=decode_layer, decode_layers=decode_layers
    )


def prepare(module: nn.Module) -> int:
    """Makes the weight copies configure's decode path will read (packed_linear.prepare) now,
    at start-up, so that no request pays them -> how many were made."""
    return packed_linear.prepare(module)

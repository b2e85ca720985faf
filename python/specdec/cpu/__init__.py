"""The CPU decode path of a module that runs for inference (the target, an EAGLE head, the
data stage's generator): prepacked bf16 linears (specdec.packed_linear,
SPECDEC_PREPACK_WEIGHTS) and the C++ layer ops with each verify step's block as one call
(specdec.layer_ops, SPECDEC_LAYER_OPS). Each part decides for itself whether it pays (bf16 /
fp16 weights on a CPU); float32 and other devices keep the torch modules."""

from torch import nn

from . import layer_ops, packed_linear


def configure(module: nn.Module) -> None:
    """Switches module's CPU decode path on or off as the environment and its weights say.
    Idempotent."""
    packed_linear.configure(module)
    layer_ops.configure(module)

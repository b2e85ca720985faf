"""Argument helpers the subcommands share (model placement flags, loading the model they name)."""


def add_model_placement_arguments(p):
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (default auto: bfloat16 on GPUs and CPUs with native bf16, else float32)")


def load_model_from_args(args):
    from ..loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device)

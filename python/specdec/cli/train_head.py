"""`specdec train-head`: train an EAGLE head (specdec.training.eagle) or Medusa heads
(--kind medusa, specdec.training.medusa) for a target by self-distillation (docs/training.md)."""

import os

import torch

from specdec.errors import InvalidRequestError
from specdec.training.data import (
    data_feature_layers,
    generate_shards,
    load_shards,
    shard_paths,
    tokenize_prompts,
)
from specdec.training.eagle import TOKEN_LOSSES, train_head


def add_arguments(p):
    p.add_argument(
        "--model", metavar="PATH", help="target: .gguf or HF dir (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="head directory to write (config.json + model.safetensors)",
    )
    p.add_argument(
        "--data-dir", metavar="DIR", help="self-distillation shards (default: OUTPUT/data)"
    )
    p.add_argument("--stage", choices=("all", "generate", "train"), default="all")
    p.add_argument(
        "--kind",
        choices=("eagle", "medusa"),
        default="eagle",
        help="what to train: an EAGLE-2 head (default) or Medusa-1 heads (same data)",
    )
    p.add_argument(
        "--medusa-heads", type=int, default=4, metavar="K", help="medusa: heads (default 4)"
    )
    p.add_argument(
        "--medusa-layers",
        type=int,
        default=1,
        metavar="N",
        help="medusa: residual blocks per head (default 1)",
    )
    p.add_argument("--num-prompts", type=int, default=2048, help="ShareGPT prompts to answer")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=128, help="longer (templated) prompts are skipped"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument(
        "--gen-temperature", type=float, default=0.0, help="0 = greedy answers (default)"
    )
    p.add_argument("--max-shards", type=int, help="stop data generation after this many shards")
    p.add_argument(
        "--features",
        choices=("hidden", "eagle3"),
        default="hidden",
        help="what generated shards store per position: the final-norm hidden (EAGLE-1/2, "
        "Medusa; 2 * dim bytes) or also the outputs of EAGLE-3's three feature layers (both "
        "EAGLE-2 and EAGLE-3 train on it; 8 * dim bytes)",
    )
    p.add_argument(
        "--gen-dtype",
        choices=("bfloat16", "float32"),
        default="float32",
        help="target dtype while generating (bfloat16 is ~2x faster on CPUs with AVX512-BF16)",
    )
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--eagle-version",
        type=int,
        choices=(2, 3),
        default=2,
        help="eagle kind: 2 = EAGLE-2 head over the final-norm hidden (default); 3 = EAGLE-3 "
        "head over the fused outputs of three target layers, with its own lm_head over the "
        "--draft-vocab (needs data made with --features eagle3)",
    )
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=1,
        help="passes per batch; > 1 trains on the head's own predicted features (EAGLE-3 "
        "training-time test)",
    )
    p.add_argument(
        "--noise",
        type=float,
        help="uniform feature noise width, relative to the feature RMS (default 0.2 for "
        "EAGLE-2, 0 for EAGLE-3, whose training-time test takes its place)",
    )
    p.add_argument(
        "--token-loss",
        choices=TOKEN_LOSSES,
        default="label",
        help="EAGLE-2 token loss: cross-entropy against the generated token (label, default) or "
        "against the target's next-token distribution (distribution: EAGLE's soft labels)",
    )
    p.add_argument(
        "--init-head",
        metavar="DIR",
        help="start from this head's weights (same EAGLE version) instead of random ones: "
        "fine-tuning, e.g. --token-loss distribution after label training",
    )
    p.add_argument(
        "--full-vocab-ce",
        action="store_true",
        help="cross-entropy over the whole vocabulary (default: over the tokens of the data)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help="draft over the N most frequent generated tokens only (stored as d2t; cuts the "
        "draft lm_head cost by V / N); 0 = the whole vocabulary (default; for EAGLE-3: "
        "every token id in the data)",
    )
    p.add_argument(
        "--val-shards", type=int, default=1, help="last shards held out for per-epoch validation"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between resumable checkpoints"
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of the saved head",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from specdec.datasets import sharegpt_prompts
    from specdec.drafters.eagle_head import eagle3_feature_layers
    from specdec.models.loader import load_model, resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_dir = args.data_dir or os.path.join(args.output, "data")
    progress = not args.no_progress
    device = resolve_device(args.device)
    if args.stage in ("all", "generate"):
        model, tokenizer = load_model(
            args.model, dtype=getattr(torch, args.gen_dtype), device=device
        )
        prompts = tokenize_prompts(
            tokenizer, sharegpt_prompts(args.num_prompts, args.seed), args.max_prompt_tokens
        )
        feature_layers = (
            eagle3_feature_layers(model.args.n_layers) if args.features == "eagle3" else ()
        )
        generate_shards(
            model,
            tokenizer,
            prompts,
            data_dir,
            args.gen_batch_size,
            args.max_new_tokens,
            args.gen_temperature,
            args.seed,
            args.max_shards,
            progress,
            feature_layers,
        )
    if args.stage in ("all", "train"):
        model, _ = load_model(args.model, device=device)
        shards = shard_paths(data_dir)
        if args.val_shards >= len(shards):
            raise InvalidRequestError(
                f"{data_dir} has {len(shards)} shards: too few to hold {args.val_shards} out"
            )
        cut = len(shards) - args.val_shards
        if args.kind == "medusa":
            from specdec.training.medusa import train_medusa

            train_medusa(
                model,
                load_shards(data_dir, shards[:cut]),
                args.output,
                num_heads=args.medusa_heads,
                num_layers=args.medusa_layers,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                full_vocab_ce=args.full_vocab_ce,
                draft_vocab=args.draft_vocab,
                checkpoint_every=args.checkpoint_every,
                save_dtype=getattr(torch, args.dtype),
                seed=args.seed,
                progress=progress,
                val_seqs=load_shards(data_dir, shards[cut:]),
            )
            return 0
        features, feature_layers = "hidden", None
        if args.eagle_version == 3:
            features, feature_layers = "aux", data_feature_layers(data_dir)
            if not feature_layers:
                raise InvalidRequestError(
                    f"{data_dir} holds no EAGLE-3 features: generate it with --features eagle3"
                )
        noise = args.noise if args.noise is not None else (0.2 if args.eagle_version < 3 else 0.0)
        train_head(
            model,
            load_shards(data_dir, shards[:cut], features),
            args.output,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            noise=noise,
            full_vocab_ce=args.full_vocab_ce,
            draft_vocab=args.draft_vocab,
            checkpoint_every=args.checkpoint_every,
            save_dtype=getattr(torch, args.dtype),
            seed=args.seed,
            progress=progress,
            val_seqs=load_shards(data_dir, shards[cut:], features),
            ttt_steps=args.ttt_steps,
            version=args.eagle_version,
            feature_layers=feature_layers,
            token_loss=args.token_loss,
            init_head=args.init_head,
        )
    return 0

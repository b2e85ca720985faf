"""The baseline a user would pick instead: Hugging Face transformers' `generate` (plain, and
prompt-lookup decoding) over the same weights, in the same dtype and on the same device as ours;
used by `specdec bench` and `specdec bench --drafters`."""

import time

import torch


def run_hf(
    hf_model,
    prompt_ids: list,
    temperature: float,
    batch_size: int,
    max_new_tokens: int,
    seed: int,
    eos_ids,
    prompt_lookup: int | None = None,
) -> dict:
    """transformers' generate (left-padded batches; prompt lookup needs batch size 1)."""
    pad = min(eos_ids)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature
        else {"do_sample": False}
    )
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}

    def generate(batch, n):
        width = max(len(p) for p in batch)
        dev = hf_model.device
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            pad_token_id=pad,
            eos_token_id=sorted(eos_ids),
            **sampling,
            **extra,
        )
        return [_strip(row[width:].tolist(), eos_ids) for row in out]

    with torch.inference_mode():
        generate(prompt_ids[:1], 2)  # warm-up
        t0 = time.perf_counter()
        outputs = []
        for i in range(0, len(prompt_ids), batch_size):
            torch.manual_seed(seed + i)
            outputs += generate(prompt_ids[i : i + batch_size], max_new_tokens)
        elapsed = time.perf_counter() - t0
    n = sum(len(o) for o in outputs)
    return {
        "num_requests": len(prompt_ids),
        "generated_tokens": n,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed,
        "mean_acceptance_length": None,
        "outputs": outputs,
    }


def _strip(ids: list, eos_ids) -> list:
    """Generated ids up to and including the first EOS (HF pads finished rows)."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def load_hf(model_path, dtype, device):
    """transformers' model over the same weights (the GGUF's cached HF conversion), in the
    dtype and on the device ours runs in."""
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import default_model_path, gguf_checkpoint_dir

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        path = gguf_checkpoint_dir(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def run_hf_specdec(
    hf_model,
    head,
    tree: str,
    prompt_ids: list,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    eos_ids,
) -> dict:
    """specdec inside transformers (specdec.integrations.transformers.generate): the HF
    model's own layers with specdec's tree attention, drafter and sampler, batch size 1, the
    prompts in one call (its setup timed too)."""
    from specdec.integrations.transformers import generate

    def run(prompts, n):
        return generate(
            hf_model,
            prompts,
            head=head,
            tree=tree,
            max_new_tokens=n,
            temperature=temperature,
            seed=seed,
            batch_size=1,
            eos_token_id=sorted(eos_ids),
        )

    run(prompt_ids[:1], 2)  # warm-up
    t0 = time.perf_counter()
    ids, stats = run(prompt_ids, max_new_tokens)
    elapsed = time.perf_counter() - t0
    outputs = [row[len(p) :] for p, row in zip(prompt_ids, ids)]
    n = sum(len(o) for o in outputs)
    return {
        "num_requests": len(prompt_ids),
        "generated_tokens": n,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed,
        "mean_acceptance_length": stats["mean_acceptance_length"],
        "outputs": outputs,
    }

"""The other baseline a CPU user would pick: llama.cpp (through llama-cpp-python), plain and with
its prompt-lookup speculation, on the same prompt token ids, token counts and threads as ours;
used by `specdec bench`. llama_cpp is imported lazily: it is an optional extra
(`pip install 'specdec[llamacpp]'`), never needed by CI.

Two GGUFs of the same weights: the shipped one at its native Q4_1, and a bf16 one written here
(every quantized tensor dequantized and stored as BF16, metadata copied), so that llama.cpp and
our bf16 model multiply the very same numbers."""

import json
import os
import time

import numpy as np

INSTALL_HINT = "pip install 'specdec[llamacpp]'"
_STAMP_SUFFIX = ".source.json"  # beside the bf16 GGUF: the Q4_1 GGUF it was written from


class LlamaCppMissingError(ImportError):
    """llama-cpp-python is not installed (the bench skips its rows)."""


def import_llama_cpp():
    """llama_cpp, or LlamaCppMissingError with the install line."""
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppMissingError(
            f"llama.cpp rows need llama-cpp-python: {INSTALL_HINT} ({e})"
        ) from None
    return llama_cpp


# ---------------------------------------------------------------------- the bf16 GGUF
def bf16_gguf_path(gguf_path: str) -> str:
    """The cached bf16 GGUF of a (quantized) GGUF, written on first use or when the source
    changed: $SPECDEC_CACHE_DIR/<name>.bf16.gguf, beside the converted HF checkpoint dir."""
    from specdec.models.loader import _source_stamp, cache_root

    gguf_path = os.path.abspath(gguf_path)
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    out = os.path.join(cache_root(), name + ".bf16.gguf")
    stamp = _source_stamp(gguf_path)
    try:
        with open(out + _STAMP_SUFFIX) as f:
            if json.load(f) == stamp and os.path.isfile(out):
                return out
    except (OSError, ValueError):
        pass
    os.makedirs(cache_root(), exist_ok=True)
    tmp = out + f".tmp{os.getpid()}"  # written aside and renamed: no half file in the cache
    try:
        write_bf16_gguf(gguf_path, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(out + _STAMP_SUFFIX, "w") as f:
        json.dump(stamp, f)
    return out


def write_bf16_gguf(src: str, dst: str) -> None:
    """Copies the GGUF src to dst with every quantized / f16 tensor dequantized and stored as
    BF16 (F32 tensors, the norms, stay F32 as in llama.cpp's own bf16 conversions) and every
    metadata key/value copied (general.file_type set to MOSTLY_BF16)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header fields and the architecture the writer writes itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_BF16)
        writer.add_key_value(name, value, vtype, sub)
    bf16 = gguf.GGMLQuantizationType.BF16
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32))
            continue
        # dequantize -> [rows, cols] float32 (numpy order: GGUF's shape reversed)
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(values, bf16), raw_dtype=bf16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------- one configuration
def load_llamacpp(gguf_path: str, threads: int, n_ctx: int, prompt_lookup: int | None, seed: int):
    """A llama_cpp.Llama over gguf_path with n_threads (prompt processing too) = threads, and
    LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) as its draft model when given."""
    llama_cpp = import_llama_cpp()
    draft = None
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    # No weight repacking ("extra buffer types"): with llama-cpp-python 0.3.36 built with
    # GGML_NATIVE on an AMX CPU, the repacked Q4_1 GGUF segfaults on its first decode. Llama()
    # reads its model params from llama_model_default_params, so that is swapped meanwhile.
    lib = llama_cpp.llama_cpp
    default_params = lib.llama_model_default_params

    def no_repack():
        params = default_params()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_repack
    try:
        return llama_cpp.Llama(
            model_path=gguf_path,
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            n_threads=threads,
            n_threads_batch=threads,
            seed=seed,
            draft_model=draft,
            verbose=False,
        )
    finally:
        lib.llama_model_default_params = default_params


def decoder(llm, temperature: float, eos_ids=()):
    """generate(prompt ids, n, seed) -> up to n token ids (through the first EOS) of llm's
    decoding of one prompt from a fresh context. Greedy (temperature 0) is llama.cpp's greedy
    sampler (argmax); sampling is plain temperature sampling (no top-k / top-p / min-p /
    repetition penalty)."""
    eos = set(eos_ids) | {llm.token_eos()}
    sampling = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)

    def generate(prompt, n, request_seed):
        # reset: no KV reuse of a previous prompt's shared prefix (our engine has none either)
        llm.reset()
        llm.set_seed(request_seed)
        out = []
        for tok in llm.generate(list(prompt), temp=temperature, **sampling):
            out.append(int(tok))
            if tok in eos or len(out) >= n:
                break
        return out

    return generate


def _warm_decoder(
    gguf_path,
    prompt_ids,
    max_new_tokens,
    temperature,
    threads,
    prompt_lookup,
    seed,
    eos_ids,
    llm=None,
):
    """decoder over llm (else gguf_path loaded, with a context for the longest prompt, its new
    tokens and the lookup's drafts), warmed up on the first prompt; untimed."""
    if llm is None:
        n_ctx = max(len(p) for p in prompt_ids) + max_new_tokens + (prompt_lookup or 0) + 16
        llm = load_llamacpp(gguf_path, threads, n_ctx, prompt_lookup, seed)
    generate = decoder(llm, temperature, eos_ids)
    generate(prompt_ids[0], 2, seed)  # warm-up
    return generate


def run_llamacpp(
    gguf_path: str,
    prompt_ids: list,
    max_new_tokens: int,
    temperature: float,
    threads: int,
    prompt_lookup: int | None,
    seed: int,
    eos_ids=(),
    llm=None,
) -> dict:
    """llama.cpp on every prompt (the same token ids ours gets, one at a time) -> the dict of
    hf_baseline.run_hf: tokens_per_s end to end, prompt processing included; outputs up to and
    including the first EOS, as `decoder` decodes them. llm: a loaded Llama to reuse (else one
    is loaded, untimed)."""
    args = (max_new_tokens, temperature, threads, prompt_lookup, seed, eos_ids, llm)
    generate = _warm_decoder(gguf_path, prompt_ids, *args)
    t0 = time.perf_counter()
    outputs = [generate(p, max_new_tokens, seed + i) for i, p in enumerate(prompt_ids)]
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


# ---------------------------------------------------------------------- the bench rows
PROMPT_LOOKUP_TOKENS = 10  # llama-cpp-python's default num_pred_tokens (and HF's row's)


def bench_ggufs(model_path: str | None, log=print) -> dict | None:
    """{label: GGUF path} of the llama.cpp rows: "bf16" (written on demand) and the GGUF's
    native type (e.g. "Q4_1"); None, after one line saying why, when llama_cpp is not
    importable or the model is not a GGUF."""
    import gguf

    from specdec.models.loader import default_model_path

    try:
        import_llama_cpp()
    except LlamaCppMissingError as e:
        log(f"[llama.cpp] rows skipped: {e}")
        return None
    path = model_path or default_model_path()
    if not path.endswith(".gguf"):
        log(f"[llama.cpp] rows skipped: {path} is not a GGUF file")
        return None
    field = gguf.GGUFReader(path).fields.get("general.file_type")
    native = gguf.LlamaFileType(field.contents()).name.removeprefix("MOSTLY_") if field else "gguf"
    return {"bf16": bf16_gguf_path(path), native: path}


def _rows(ggufs: dict, temperature: float) -> list:
    """(row name, GGUF path, prompt-lookup tokens or None) of the llama.cpp rows."""
    return [
        (f"llama.cpp {label}" + (" + prompt lookup" if lookup else ""), path, lookup)
        for label, path in ggufs.items()
        for lookup in ((None, PROMPT_LOOKUP_TOKENS) if temperature == 0 else (None,))
    ]


def bench_rows(ggufs: dict, prompt_ids, max_new_tokens, temperature, threads, seed, eos) -> dict:
    """{"llama.cpp LABEL": result, "llama.cpp LABEL + prompt lookup": result (greedy only)}
    for every GGUF of bench_ggufs, with outputs (as run_llamacpp)."""
    rows = {}
    for name, path, lookup in _rows(ggufs, temperature):
        rows[name] = run_llamacpp(
            path, prompt_ids, max_new_tokens, temperature, threads, lookup, seed, eos
        )
    return rows


def bench_decoders(ggufs: dict, prompt_ids, max_new_tokens, temperature, threads, seed, eos):
    """[(row name, decoder)] of bench_rows' rows, each model loaded and warmed up once (the
    interleaved bench decodes one prompt at a time: decoder(prompt, n, seed) -> token ids)."""
    run = (max_new_tokens, temperature, threads)
    return [
        (name, _warm_decoder(path, prompt_ids, *run, lookup, seed, eos))
        for name, path, lookup in _rows(ggufs, temperature)
    ]


def config(ggufs: dict) -> dict:
    """What the JSON records about the llama.cpp rows."""
    llama_cpp = import_llama_cpp()
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "ggufs": ggufs,
        "prompt_lookup_tokens": PROMPT_LOOKUP_TOKENS,
        "kv_cache": "llama.cpp default (f16), reset per prompt",
        "weight_repacking": False,
    }

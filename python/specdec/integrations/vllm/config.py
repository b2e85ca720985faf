"""`speculative_config(method, **options)`: the dict vLLM's `speculative_config` takes, for
every specdec method vLLM can host.

    from vllm import LLM
    from specdec.integrations.vllm import speculative_config

    llm = LLM(model_dir, speculative_config=speculative_config("eagle"))        # shipped EAGLE-2
    llm = LLM(model_dir, speculative_config=speculative_config("ngram", sampler="specdec"))

    vllm serve MODEL_DIR --speculative-config "$(python -c 'import json; from
        specdec.integrations.vllm import speculative_config; print(json.dumps(
        speculative_config("medusa")))')"

Methods (docs/integration.md, "In vLLM", has the table of what runs where):
- "eagle", "eagle3", "medusa": the head (option head=, default the shipped one) exported with
  export.export_head into a cache directory, run by vLLM's own method of that name; "eagle"
  with an EAGLE-3 head becomes "eagle3".
- "ngram": specdec's n-gram drafter as a custom_class proposer (proposers.NgramProposer).
- tree=True / "dynamic:D,K,N" / "adaptive[:D,K,N]" ("eagle", "eagle3", "ngram", and
  "eagle+ngram", which needs one): the drafter's trees verified inside vLLM's step
  (trees.py), drafted by specdec's own drafter hosted as a custom_class proposer
  (hosted.DrafterProposer); num_speculative_tokens is then the tree's node count less the
  root. tree=True is a static tree of DEFAULT_TREE_NODES drafts (n-gram: tree_depth and
  tree_branches shape it); "adaptive" sizes each step with specdec's policy.

Options: num_speculative_tokens (the chain depth; default 4, Medusa its head count), head,
model (the target, .gguf or checkpoint dir; default the default model), export_dir, ngram_max
/ ngram_min ("ngram"), draft_dtype (trees: the hosted drafter's precision, "auto" (the
default: bfloat16 on a CPU with native bf16 arithmetic, else float32), "bfloat16", "float16"
or "float32"; any value keeps the output exact, hosted.py), sampler ("vllm", the default, or
"specdec": vLLM's rejection sampling through torch.ops.specdec.tree_rejection_sample,
sampler.py). specdec's own options travel in the dict under the key "specdec"; the plugin
(plugin.py) moves them into vLLM's additional_config before vLLM validates the dict, so they
need the plugin installed (the `vllm.general_plugins` entry point of `pip install specdec`).
"""

import hashlib
import json
import os
import shutil
import tempfile

from specdec.errors import InvalidRequestError
from specdec.integrations.vllm import version
from specdec.integrations.vllm.options import check_draft_dtype

OPTIONS_KEY = "specdec"  # the dict's key holding specdec's own options (plugin.py reads it)
SAMPLERS = ("vllm", "specdec")
DEFAULT_DEPTH = 4
HEAD_METHODS = ("eagle", "eagle3", "medusa")
TREE_METHODS = ("eagle", "eagle3", "ngram", "eagle+ngram")
METHODS = HEAD_METHODS + ("ngram", "eagle+ngram")
NGRAM_PROPOSER = "specdec.integrations.vllm.proposers.NgramProposer"
HOSTED_PROPOSER = "specdec.integrations.vllm.hosted.DrafterProposer"
DEFAULT_TREE_NODES = 8  # drafted nodes below the root of tree=True (num_speculative_tokens)
_HEAD_OPTIONS = {
    "num_speculative_tokens",
    "head",
    "model",
    "export_dir",
    "sampler",
    "tree",
    "draft_dtype",
}
_NGRAM_OPTIONS = {"num_speculative_tokens", "ngram_max", "ngram_min", "sampler", "tree"}
_OPTIONS = {
    "eagle": _HEAD_OPTIONS,
    "eagle3": _HEAD_OPTIONS,
    "medusa": _HEAD_OPTIONS - {"tree", "draft_dtype"},
    "ngram": _NGRAM_OPTIONS | {"tree_branches", "tree_depth", "draft_dtype"},
    "eagle+ngram": (_HEAD_OPTIONS | _NGRAM_OPTIONS) - {"model", "export_dir"},
}
_NOT_HOSTED = {
    "plain": "plain decoding is vLLM without a speculative_config (pass None)",
    "draft": "use vLLM's own draft_model method with the draft checkpoint directory",
}


def speculative_config(method: str, **options) -> dict:
    """The dict for `vllm.LLM(speculative_config=...)` (as JSON: `vllm serve
    --speculative-config`) running specdec method `method` (METHODS) inside vLLM; options as
    in the module docstring. Bad methods and options raise InvalidRequestError naming them;
    a vLLM outside the tested range raises version.VllmVersionError."""
    if method in _NOT_HOSTED:
        raise InvalidRequestError(f"speculative_config: method {method!r}: {_NOT_HOSTED[method]}")
    if method not in METHODS:
        raise InvalidRequestError(
            f"speculative_config: unknown method {method!r}; vLLM hosts {', '.join(METHODS)}"
        )
    unknown = sorted(set(options) - _OPTIONS[method])
    if unknown:
        raise InvalidRequestError(
            f"speculative_config({method!r}): unknown option(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(_OPTIONS[method]))}"
        )
    version.check()
    sampler = options.get("sampler", "vllm")
    if sampler not in SAMPLERS:
        raise InvalidRequestError(
            f"speculative_config: sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}"
        )
    specdec_options = {"sampler": "specdec"} if sampler == "specdec" else {}
    depth = options.get("num_speculative_tokens")
    if depth is not None:
        _check_positive_int("num_speculative_tokens", depth)
    if "draft_dtype" in options and not (options.get("tree") or method == "eagle+ngram"):
        raise InvalidRequestError(
            f"speculative_config({method!r}): draft_dtype sets the hosted drafter's precision "
            "(trees) only; vLLM's own methods draft in the engine's dtype"
        )
    if options.get("tree") or method == "eagle+ngram":
        config = _tree_config(method, depth, options, sampler)
        specdec_options.update(config.pop(OPTIONS_KEY))
    elif method == "ngram":
        for name in ("ngram_max", "ngram_min"):
            if name in options:
                _check_positive_int(name, options[name])
                specdec_options[name] = options[name]
        lo, hi = specdec_options.get("ngram_min", 1), specdec_options.get("ngram_max", 4)
        if lo > hi:
            raise InvalidRequestError(
                f"speculative_config: ngram_min ({lo}) must be <= ngram_max ({hi})"
            )
        shaping = sorted({"tree_branches", "tree_depth"} & set(options))
        if shaping:
            raise InvalidRequestError(
                f"speculative_config('ngram'): {', '.join(shaping)} shape tree=True only"
            )
        config = {
            "method": "custom_class",
            "model": NGRAM_PROPOSER,
            "num_speculative_tokens": depth or DEFAULT_DEPTH,
        }
    else:
        config = _head_config(method, depth, options)
    if specdec_options:
        config[OPTIONS_KEY] = specdec_options
    return config


def _tree_config(method: str, depth, options, sampler: str) -> dict:
    """The hosted proposer's config: tree spec, drafter, head, n-gram lengths."""
    from specdec.errors import InvalidTreeSpecError
    from specdec.speculation.trees import TreeSpec

    if "sampler" in options and sampler != "specdec":
        raise InvalidRequestError(
            f"speculative_config({method!r}): trees need sampler='specdec' (vLLM's rejection "
            "sampler verifies chains only)"
        )
    tree = options.get("tree", True)
    if tree is False:
        raise InvalidRequestError(
            f"speculative_config({method!r}): the merged drafter drafts trees only: pass "
            "tree=True, 'dynamic:D,K,N' or 'adaptive[:D,K,N]'"
        )
    ngram = {name: options[name] for name in ("ngram_max", "ngram_min") if name in options}
    for name, value in ngram.items():
        _check_positive_int(name, value)
    if ngram.get("ngram_min", 1) > ngram.get("ngram_max", 4):
        raise InvalidRequestError(
            f"speculative_config: ngram_min ({ngram['ngram_min']}) must be <= ngram_max "
            f"({ngram.get('ngram_max', 4)})"
        )
    for name in ("tree_branches", "tree_depth"):
        if name in options:
            _check_positive_int(name, options[name])
            if tree is not True:
                raise InvalidRequestError(
                    f"speculative_config({method!r}): {name} shapes tree=True only"
                )
    if tree is True:
        nodes = depth or DEFAULT_TREE_NODES
        # half the nodes deep by default, so that a second branch finds room
        tree_depth = options.get("tree_depth", max(1, nodes // 2))
        branches = options.get("tree_branches", 3 if method == "ngram" else 4)
        text = f"dynamic:{min(tree_depth, nodes)},{min(branches, nodes)},{nodes + 1}"
    elif isinstance(tree, str):
        text = tree
    else:
        raise InvalidRequestError(
            f"speculative_config({method!r}): tree must be True, 'dynamic:D,K,N' or "
            f"'adaptive[:D,K,N]', got {tree!r}"
        )
    try:
        spec = TreeSpec.parse(text)
    except InvalidTreeSpecError as e:
        raise InvalidRequestError(f"speculative_config({method!r}): tree: {e}") from None
    if spec.kind == "chain":
        raise InvalidRequestError(
            f"speculative_config({method!r}): tree {text!r} is a chain; pass tree=False "
            "(vLLM's own chain speculation) or a dynamic / adaptive tree"
        )
    if depth is not None and depth != spec.num_nodes - 1:
        raise InvalidRequestError(
            f"speculative_config({method!r}): num_speculative_tokens ({depth}) must equal "
            f"the tree's drafts ({spec.num_nodes - 1} for {spec})"
        )
    options_out = {"tree": True, "sampler": "specdec", "drafter": method, "tree_spec": str(spec)}
    if "draft_dtype" in options:
        options_out["draft_dtype"] = check_draft_dtype(options["draft_dtype"])
    if method == "eagle3":
        options_out["drafter"] = "eagle"
    if method != "ngram":
        from specdec.heads import DEFAULT_HEAD, EAGLE3_HEAD
        from specdec.integrations.vllm.export import head_kind, resolve_head_dir

        head = options.get("head") or (EAGLE3_HEAD if method == "eagle3" else DEFAULT_HEAD)
        head_dir = resolve_head_dir(head)
        kind = head_kind(head_dir)
        if kind == "medusa" or (method == "eagle3" and kind != "eagle3"):
            raise InvalidRequestError(
                f"speculative_config({method!r}): head {options.get('head')!r} is a {kind} head"
            )
        options_out["head"] = head_dir
    options_out.update(ngram if method in ("ngram", "eagle+ngram") else {})
    return {
        "method": "custom_class",
        "model": HOSTED_PROPOSER,
        "num_speculative_tokens": spec.num_nodes - 1,
        OPTIONS_KEY: options_out,
    }


def _head_config(method: str, depth, options) -> dict:
    from specdec.heads import DEFAULT_HEAD, DEFAULT_MEDUSA, EAGLE3_HEAD
    from specdec.integrations.vllm.export import head_kind, resolve_head_dir

    default = {"eagle": DEFAULT_HEAD, "eagle3": EAGLE3_HEAD, "medusa": DEFAULT_MEDUSA}[method]
    head_dir = resolve_head_dir(options.get("head") or default)
    kind = head_kind(head_dir)
    if (kind == "medusa") != (method == "medusa") or (method == "eagle3" and kind != "eagle3"):
        raise InvalidRequestError(
            f"speculative_config({method!r}): head {options.get('head')!r} is a {kind} head"
        )
    exported = export_cached(head_dir, options.get("model"), options.get("export_dir"))
    if depth is None:
        depth = exported.num_speculative_tokens
    if kind == "medusa" and depth > exported.num_speculative_tokens:
        raise InvalidRequestError(
            f"speculative_config('medusa'): num_speculative_tokens {depth} exceeds the "
            f"{exported.num_speculative_tokens} Medusa heads"
        )
    return {"method": kind, "model": exported.path, "num_speculative_tokens": depth}


def export_cached(head_dir: str, model: str | None = None, export_dir: str | None = None):
    """export.export_head into export_dir (default: a directory under specdec's cache named
    after the head, the target and their files' sizes and times), reusing an export whose
    record matches -> export.ExportedHead. Written into a temporary sibling and renamed, so
    a reader never sees half an export."""
    from specdec.integrations.vllm.export import EXPORT_RECORD, ExportedHead, export_head
    from specdec.models.loader import cache_root

    stamp = _stamp(head_dir, model)
    if export_dir is None:
        name = os.path.basename(os.path.normpath(head_dir))
        export_dir = os.path.join(cache_root(), "vllm-heads", f"{name}-{stamp[:12]}")
    record = os.path.join(export_dir, EXPORT_RECORD)
    if os.path.isfile(record):
        with open(record) as f:
            saved = json.load(f)
        if saved.get("stamp") == stamp:
            saved.pop("stamp")
            return ExportedHead(**saved)
    parent = os.path.dirname(os.path.abspath(export_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".exporting-", dir=parent)
    try:
        exported = export_head(head_dir, tmp, model)
        with open(os.path.join(tmp, EXPORT_RECORD)) as f:
            saved = json.load(f)
        saved["stamp"] = stamp
        saved["path"] = os.path.abspath(export_dir)
        with open(os.path.join(tmp, EXPORT_RECORD), "w") as f:
            json.dump(saved, f, indent=2)
        os.chmod(tmp, 0o755)
        shutil.rmtree(export_dir, ignore_errors=True)
        os.replace(tmp, export_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportedHead(
        os.path.abspath(export_dir),
        exported.method,
        exported.num_speculative_tokens,
        exported.source,
        exported.notes,
    )


def _stamp(head_dir: str, model: str | None) -> str:
    from specdec.integrations.vllm.export import FORMAT_VERSION

    parts = [str(FORMAT_VERSION), os.path.abspath(head_dir), str(model)]
    for name in sorted(os.listdir(head_dir)):
        st = os.stat(os.path.join(head_dir, name))
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(
            f"speculative_config: {name} must be an integer >= 1, got {value!r}"
        )

"""specdec's own options inside a vLLM engine: what `speculative_config(...)` puts under the
key "specdec" and the plugin moves into vLLM's `additional_config["specdec"]`, which vLLM
hands to every worker with the rest of its config.

    {"sampler": "specdec"}          rejection sampling through tree_rejection_sample
    {"ngram_max": 4, "ngram_min": 1} the n-gram proposer's match lengths
    {"tree": True, "drafter": "eagle+ngram", "tree_spec": "adaptive", "head": DIR}
                                    trees verified inside vLLM's step (trees.py), drafted by
                                    specdec's drafter hosted in vLLM (hosted.py)
    {"draft_dtype": "auto"}         the hosted drafter's precision (hosted.py)

SPECDEC_VLLM_SAMPLER=1 in the environment turns the sampler on as {"sampler": "specdec"} does
(for a `vllm serve` started without specdec's options, say).
"""

from specdec import envs
from specdec.errors import InvalidRequestError

KEY = "specdec"
KNOWN = {"sampler", "ngram_max", "ngram_min", "tree", "drafter", "tree_spec", "head", "draft_dtype"}
DRAFTERS = ("ngram", "eagle", "eagle+ngram")
DRAFT_DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_draft_dtype(value) -> str:
    """The hosted drafter's dtype option -> value; InvalidRequestError naming it when bad."""
    if value not in DRAFT_DTYPES:
        raise InvalidRequestError(
            f"speculative_config['{KEY}']['draft_dtype'] must be one of "
            f"{', '.join(DRAFT_DTYPES)}, got {value!r}"
        )
    return value


def check_options(options) -> dict:
    """options (the "specdec" value of a speculative config) -> options; InvalidRequestError
    naming what is wrong."""
    if not isinstance(options, dict):
        raise InvalidRequestError(
            f"speculative_config['{KEY}'] must be a dict of specdec options, got {options!r}"
        )
    unknown = sorted(set(options) - KNOWN)
    if unknown:
        raise InvalidRequestError(
            f"speculative_config['{KEY}']: unknown option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(KNOWN))}"
        )
    if options.get("sampler", "vllm") not in ("vllm", "specdec"):
        raise InvalidRequestError(
            f"speculative_config['{KEY}']['sampler'] must be 'vllm' or 'specdec', got "
            f"{options['sampler']!r}"
        )
    if options.get("tree", False) not in (True, False):
        raise InvalidRequestError(
            f"speculative_config['{KEY}']['tree'] must be true or false, got {options['tree']!r}"
        )
    if options.get("tree") and (
        options.get("drafter", "ngram") not in DRAFTERS or not options.get("tree_spec")
    ):
        raise InvalidRequestError(
            f"speculative_config['{KEY}']: trees need a drafter ({', '.join(DRAFTERS)}) and a "
            f"tree_spec, got {options.get('drafter')!r} / {options.get('tree_spec')!r}"
        )
    if options.get("tree") and options.get("sampler") != "specdec":
        raise InvalidRequestError(
            f"speculative_config['{KEY}']: trees need sampler 'specdec' (vLLM's own rejection "
            "sampler verifies chains only)"
        )
    if "draft_dtype" in options:
        check_draft_dtype(options["draft_dtype"])
    return options


def specdec_options(vllm_config) -> dict:
    """The specdec options of an engine's VllmConfig ({} when none were given, or None)."""
    extra = getattr(vllm_config, "additional_config", None)
    options = extra.get(KEY) if isinstance(extra, dict) else None
    return dict(options or {})


def sampler_enabled(vllm_config) -> bool:
    """Whether the engine's rejection sampling goes through specdec (option or environment)."""
    if envs.SPECDEC_VLLM_SAMPLER:
        return True
    return specdec_options(vllm_config).get("sampler") == "specdec"

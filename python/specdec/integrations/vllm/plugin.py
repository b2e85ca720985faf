"""The vLLM general plugin: `register()` is the `vllm.general_plugins` entry point "specdec"
(pyproject.toml), which vLLM runs in every process it starts (the API server or the `LLM`'s
process, the engine core, each worker) before it reads its configuration.

It installs two hooks, both only on the tested vLLM release (version.py; any other release
gets a warning and an untouched vLLM, and specdec's options are then refused by vLLM itself as
unknown keys):

- EngineArgs.create_speculative_config: the speculative config's "specdec" options (what
  `speculative_config(...)` adds, options.py) are checked and moved into vLLM's
  additional_config before vLLM validates the dict, which forbids unknown keys; vLLM then
  hands them to every worker inside its VllmConfig.
- RejectionSampler: an engine's rejection sampler built while its config asks for specdec's
  sampler (option or SPECDEC_VLLM_SAMPLER=1) runs each forward with the module-level
  rejection_sample (and expand_batch_to_tokens) it calls routed to sampler.py's
  (sampler.routed()); other engines' samplers are untouched, in the same process too. The
  routing happens at call time, after the CPU platform has registered its own kernels, so
  nothing overwrites it.

- Trees: an engine whose config asks for trees (option "tree") gets specdec's attention
  backend (attention.py: tree_verify over vLLM's paged cache) from the CPU platform's backend
  selection, and its model runner's input preparation, sampling and drafting hooks
  (trees.py: tree positions, tree rejection sampling, compact_kv).
"""

import logging

from specdec.errors import InvalidRequestError
from specdec.integrations.vllm import version
from specdec.integrations.vllm.options import KEY, check_options, sampler_enabled

# a child of vLLM's logger, so that its messages show with vLLM's own (vLLM configures "vllm")
logger = logging.getLogger("vllm.specdec")
_MARK = "_specdec_hook"


def register() -> None:
    """The entry point (see the module docstring). Safe to call more than once."""
    import vllm

    if not version.is_supported(vllm.__version__):
        logger.warning(
            "specdec: vLLM %s is outside the tested range %s; specdec's vLLM hooks are off",
            vllm.__version__,
            version.TESTED_RANGE,
        )
        return
    _hook_speculative_options()
    _hook_rejection_sampler()
    _hook_trees()


def _hook_speculative_options() -> None:
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config
    if getattr(create, _MARK, False):
        return

    def create_speculative_config(self, *args, **kwargs):
        move_specdec_options(self)
        return create(self, *args, **kwargs)

    setattr(create_speculative_config, _MARK, True)
    EngineArgs.create_speculative_config = create_speculative_config


def move_specdec_options(engine_args) -> None:
    """engine_args.speculative_config["specdec"] (checked: options.check_options) ->
    engine_args.additional_config["specdec"] (merged over what is there); nothing without."""
    spec = engine_args.speculative_config
    if not (isinstance(spec, dict) and KEY in spec):
        return
    options = check_options(spec[KEY])
    extra = engine_args.additional_config
    if not isinstance(extra, dict):
        raise InvalidRequestError(
            f"specdec options need additional_config to be a dict, got {type(extra).__name__}"
        )
    engine_args.speculative_config = {k: v for k, v in spec.items() if k != KEY}
    engine_args.additional_config = {**extra, KEY: {**(extra.get(KEY) or {}), **options}}


def _hook_rejection_sampler() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    init, forward = RejectionSampler.__init__, RejectionSampler.forward
    if getattr(init, _MARK, False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.specdec_sampler = sampler_enabled(_current_config())
        if self.specdec_sampler:
            logger.info("specdec: rejection sampling through tree_rejection_sample")  # bench.py

    def forward_(self, *args, **kwargs):
        if not getattr(self, "specdec_sampler", False):
            return forward(self, *args, **kwargs)
        from specdec.integrations.vllm import sampler

        with sampler.routed():
            return forward(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    RejectionSampler.__init__ = __init__
    RejectionSampler.forward = forward_


def _hook_trees() -> None:
    """Engines whose config asks for trees (options "tree") get the tree attention backend
    (attention.py) and the runner hooks (trees.py); others are untouched."""
    from vllm.platforms.cpu import CpuPlatform

    from specdec.integrations.vllm import trees

    trees.install()
    select = CpuPlatform.get_attn_backend_cls
    if getattr(select, _MARK, False):
        return

    def building_tree_engine() -> bool:
        config = _current_config()
        return config is not None and trees.trees_enabled(config)

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if building_tree_engine():
            from specdec.integrations.vllm.attention import BACKEND_PATH

            logger.info("specdec: tree attention backend (tree_verify over the paged cache)")
            return BACKEND_PATH
        return select.__func__(cls, selected_backend, attn_selector_config, num_heads)

    setattr(get_attn_backend_cls, _MARK, True)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    # vLLM caches its selection per layer signature, not per engine: a tree engine's selection
    # skips the cache (so one process can hold tree and plain engines)
    from vllm.v1.attention import selector

    cached = selector._cached_get_attn_backend

    def _cached_get_attn_backend(*args, **kwargs):
        if building_tree_engine():
            return cached.__wrapped__(*args, **kwargs)
        return cached(*args, **kwargs)

    selector._cached_get_attn_backend = _cached_get_attn_backend


def _current_config():
    """The VllmConfig of the engine being built (None outside one: vLLM 0.32 raises then)."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except AssertionError:
        return None

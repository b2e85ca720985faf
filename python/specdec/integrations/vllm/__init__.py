"""specdec inside vLLM (docs/integration.md, "In vLLM").

- speculative_config(method, **options): the dict `vllm.LLM(speculative_config=...)` /
  `vllm serve --speculative-config` takes for a specdec method (config.py).
- export_head(head, out_dir): a specdec head as a checkpoint vLLM's eagle / eagle3 / medusa
  methods load (export.py; the CLI: `specdec export-head NAME|DIR --format vllm --out DIR`).
- the general plugin (plugin.register, the `vllm.general_plugins` entry point): specdec's
  options inside vLLM's config and, on request, vLLM's rejection sampling through
  torch.ops.specdec.tree_rejection_sample (sampler.py).
- proposers.NgramProposer: specdec's n-gram drafter as a custom_class proposer.

Nothing here imports vLLM at import time: configs and exports are written without it (for a
server on another host, say). Tested range: version.TESTED_RANGE.
"""

from specdec.integrations.vllm.config import METHODS, speculative_config
from specdec.integrations.vllm.export import ExportedHead, export_head
from specdec.integrations.vllm.version import TESTED_RANGE, VllmVersionError

__all__ = [
    "METHODS",
    "TESTED_RANGE",
    "ExportedHead",
    "VllmVersionError",
    "export_head",
    "speculative_config",
]

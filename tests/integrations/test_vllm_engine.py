"""specdec in a running vLLM engine (float32, enforce_eager, a few MT-bench prompts): every
exported shipped head drafts in vLLM with greedy output token-identical to vLLM plain, the
n-gram proposer too, with vLLM's rejection sampling routed through specdec's op. One engine
process per configuration (bench.run_engine_process, the benchmark's own runner), each run
once per module."""

import functools

import pytest

from specdec.integrations.vllm.version import INSTALL_HINT, installed_version

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        installed_version() is None, reason=f"vLLM is not installed: {INSTALL_HINT}"
    ),
]

NUM_PROMPTS, MAX_NEW_TOKENS = 3, 24


@pytest.fixture(scope="module")
def engine(model_dir):
    """engine(method, **options) -> run_engine's batch-1 row (outputs, acceptance counters)
    plus "specdec_sampler"; method None is vLLM plain."""
    from specdec.bench.vllm import run_engine_process
    from specdec.datasets import mtbench_prompts
    from specdec.integrations.vllm import speculative_config
    from specdec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in mtbench_prompts(NUM_PROMPTS)
    ]

    @functools.cache
    def run(method=None, sampler="vllm"):
        spec = None if method is None else speculative_config(method, sampler=sampler)
        out = run_engine_process(
            {
                "model_dir": model_dir,
                "dtype": "float32",
                "threads": 2,
                "prompt_ids": prompts,
                "max_new_tokens": MAX_NEW_TOKENS,
                "concurrency": 0,
                "eos": sorted(tok.eos_token_ids),
                "seed": 0,
                "enforce_eager": True,
                "speculative_config": spec,
            }
        )
        return {**out["batch1"], "specdec_sampler": out["specdec_sampler"]}

    return run


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_exported_heads_are_exact_and_draft(engine, method):
    plain, spec = engine(), engine(method)
    assert spec["outputs"] == plain["outputs"]
    assert spec["drafts"] > 0 and not spec["specdec_sampler"]
    # a head drafting from the wrong features (a wrong EAGLE-3 layer id, say) accepts ~nothing
    assert spec["tokens_per_forward"] > 1.1, spec


def test_ngram_proposer_with_specdec_sampler_is_exact(engine):
    plain, spec = engine(), engine("ngram", sampler="specdec")
    assert spec["specdec_sampler"], "the worker did not route rejection sampling to specdec"
    assert spec["outputs"] == plain["outputs"]
    assert spec["drafts"] > 0


def test_the_guides_vllm_example_runs(tmp_path):
    """docs/integration.md's vLLM script (the block with the __main__ guard), run as a
    script: an engine with the exported EAGLE-3 head and specdec's sampler."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integration.md"
    blocks = re.findall(r"^```python\n(.*?)^```$", guide.read_text(), flags=re.S | re.M)
    (script,) = [b for b in blocks if 'if __name__ == "__main__":' in b]
    path = tmp_path / "example.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # vLLM logs to stdout: the worker's line saying it samples through specdec's op
    assert "rejection sampling through tree_rejection_sample" in proc.stdout + proc.stderr

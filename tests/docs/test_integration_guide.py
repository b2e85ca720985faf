"""Every code block of docs/integration.md runs, in order, in one namespace (as a reader would
paste them), and its own asserts hold."""

import pathlib
import re

import pytest

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integration.md"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_guide_has_the_sections_and_blocks():
    text = GUIDE.read_text()
    for section in ("## The step", "## Layouts", "## Under CUDA graphs", "## Tensor parallelism"):
        assert section in text
    assert len(code_blocks(text)) >= 5


def test_guide_code_blocks_run():
    namespace: dict = {"__name__": "integration_guide"}
    for i, block in enumerate(code_blocks(GUIDE.read_text())):
        try:
            exec(compile(block, f"{GUIDE.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # name the block that broke
            pytest.fail(f"code block {i} of {GUIDE.name} raised {type(e).__name__}: {e}")

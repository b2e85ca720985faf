"""tools/check_words.py, which `make lint` runs: it fails on a planted diary word and passes
on the product's own words."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "check_words.py")


def check(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "text",
    [
        '"""Measured in session 3."""',  # check_words: allow
        "# see issue 12",  # check_words: allow
        "x = 1  # lent a GPU",  # check_words: allow
        "# as the previous turn found",  # check_words: allow
        "name = 'e2e_session8.json'",  # check_words: allow
    ],
)
def test_fails_on_a_planted_diary_word(tmp_path, text):
    path = tmp_path / "planted.py"
    path.write_text(f"def f():\n    {text}\n")
    proc = check(path)
    assert proc.returncode == 1 and "planted.py:2" in proc.stderr


def test_passes_on_product_words(tmp_path):
    path = tmp_path / "fine.py"
    path.write_text(
        '"""MT-bench first turns; the policy turns speculation off; returns a tensor."""\n'
        "subprocess.Popen(['true'], start_new_session=True)\n"
    )
    assert check(path).returncode == 0


def test_the_tree_passes():
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the tracked files are unknown")
    proc = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr

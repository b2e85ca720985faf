"""The seeded op fuzzer (tests/ops/fuzz_ops.py) in a subprocess: random valid inputs equal the
reference, random invalid inputs raise a RuntimeError naming the argument, nothing crashes or
hangs. A longer run: `python tests/ops/fuzz_ops.py --op OP --backends cpp,triton --cases 5000`.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

FUZZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_ops.py")
OPS = ["build_tree_mask", "tree_verify", "tree_rejection_sample", "compact_kv"]
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def run_fuzzer(op, backends, cases, seed, timeout=300):
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        proc = subprocess.run(
            [
                sys.executable,
                FUZZER,
                "--op",
                op,
                "--backends",
                backends,
                "--cases",
                str(cases),
                "--seed",
                str(seed),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        last = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-1:]
        pytest.fail(f"fuzzer hung (> {timeout} s); last case started: {last}")
    lines = proc.stdout.strip().splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    assert proc.returncode >= 0, (
        f"fuzzer crashed (signal {-proc.returncode}) in "
        f"{lines[-1] if lines else '?'}\n{proc.stderr[-2000:]}"
    )
    assert proc.returncode == 0 and not fails, "\n".join(fails[:20]) + proc.stderr[-2000:]
    assert lines and lines[-1] == f"done {op}: {cases} cases, 0 failures", lines[-3:]


@pytest.mark.parametrize("op", OPS)
def test_fuzz_cpp(op):
    run_fuzzer(op, "cpp,reference", cases=90, seed=1)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("op", OPS)
def test_fuzz_triton(op):
    run_fuzzer(op, "triton", cases=24, seed=2)


def test_fuzzer_catches_a_missing_check(tmp_path):
    """The fuzzer can fail: with the shared check of build_tree_mask switched off for the
    reference backend (a kernel that trusts its input), corrupted trees pass silently."""
    shim = tmp_path / "shim.py"
    shim.write_text(
        "import runpy, sys, types, torch\n"
        "import specdec_kernels.ops as ops\n"
        "specdec = types.SimpleNamespace(_check_build_tree_mask=lambda *a: None)\n"
        "ops.torch = types.SimpleNamespace(ops=types.SimpleNamespace(specdec=specdec))\n"
        f"sys.argv = [{FUZZER!r}, '--op', 'build_tree_mask', '--backends', 'reference',"
        " '--cases', '30']\n"
        f"runpy.run_path({FUZZER!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, str(shim)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "did not raise" in proc.stdout

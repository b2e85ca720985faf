"""No import cycles (issue 11): entry points import the library, never the reverse.

The graph is read from the source (every `import` / `from ... import`, also those inside
functions, since a lazy import back into an entry point is still a cycle) plus the module
names the CLI loads with importlib; the runtime checks use fresh interpreters."""

import ast
import os
import subprocess
import sys

import pytest

import specdec
import specdec_kernels

PACKAGE_DIR = os.path.dirname(specdec.__file__)
ENTRY_POINTS = {"specdec.cli", "specdec.__main__", "specdec.train", "specdec.bench"}  # -m targets
# subcommand modules: they may import the applications' argument helpers
APPLICATIONS = ("specdec.apps", "specdec.serve.command")


def module_files():
    for root, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PACKAGE_DIR))[:-3]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                yield name, os.path.join(root, f)


def import_graph():
    files = dict(module_files())
    graph = {}
    for name, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [node.value]  # importlib.import_module("specdec.apps.generate")
            deps |= {t for t in targets if t in files and t != name and t != "specdec"}
        graph[name] = deps
    return graph


def find_cycle(graph):
    state = {}

    def visit(node, stack):
        state[node] = "active"
        for dep in sorted(graph[node]):
            if state.get(dep) == "active":
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                cycle = visit(dep, stack + [dep])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert {"specdec.cli", "specdec.apps.generate", "specdec.apps.train", "specdec.engine"} <= set(
        graph
    )
    assert "specdec.apps.generate" in graph["specdec.cli"]  # the lazy subcommands are seen
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_layers():
    """Only entry points import the CLI; only entry points and applications import the apps."""
    graph = import_graph()
    for name, deps in graph.items():
        if name not in ENTRY_POINTS:
            assert not deps & ENTRY_POINTS, f"{name} imports an entry point: {deps & ENTRY_POINTS}"
        if name not in ENTRY_POINTS and not name.startswith(APPLICATIONS):
            apps = {d for d in deps if d.startswith("specdec.apps")}
            assert not apps, f"library module {name} imports the applications {apps}"


def run_python(*args):
    """A fresh interpreter that imports this specdec / specdec_kernels (run from elsewhere, so a
    source checkout in the working directory cannot shadow an installed build)."""
    roots = {
        os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
        for m in (specdec, specdec_kernels)
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(PACKAGE_DIR),
    )


def test_subcommands_load_lazily():
    code = (
        "import sys; from specdec.cli import build_parser; "
        "before = set(sys.modules); build_parser(['generate', '--prompt', 'x']); "
        "print(sorted(m for m in before if m.split('.')[0] in ('specdec', 'torch'))); "
        "print(sorted(m for m in sys.modules if m.startswith('specdec.apps')))"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    at_import, after_parse = proc.stdout.splitlines()
    assert eval(at_import) == [
        "specdec",
        "specdec.cli",
        "specdec.errors",
    ]  # no torch for `specdec --help`
    assert eval(after_parse) == [
        "specdec.apps",
        "specdec.apps.common",
        "specdec.apps.drafter_choice",
        "specdec.apps.generate",
    ]


def test_module_entry_points():
    """`python -m specdec`, and the old `python -m specdec.train` / `specdec.bench` redirects."""
    for module, subcommand, flag in (
        ("specdec", None, "generate"),
        ("specdec.train", "train-head", "--ttt-steps"),
        ("specdec.bench", "bench", "--chain-ks"),
    ):
        proc = run_python("-m", module, "--help")
        assert proc.returncode == 0 and flag in proc.stdout, (module, proc.stdout, proc.stderr)
        if subcommand:
            assert proc.stdout.startswith(f"usage: specdec {subcommand}"), proc.stdout


def test_every_package_is_installed():
    """Each package directory of the checkout is listed in pyproject.toml, so that `pip install`
    ships it (a subpackage missing there imports from a checkout but not from an install)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools_cfg = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    found = set()
    for name, src in setuptools_cfg["package-dir"].items():
        base = os.path.join(root, src)
        for dirpath, _, files in os.walk(base):
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, base)
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found <= listed, f"not in pyproject.toml [tool.setuptools] packages: {found - listed}"

"""The package's layering: no import cycles, and imports flow one way, from the kernels up
(models, cpu, speculation, drafters, runtime, then the applications, then the command line).

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
ENTRY_POINTS = {"specdec.__main__"}  # -m targets
# the layers, lowest first: a module may import its own layer and the layers below it. Layer 0
# holds the package's leaf modules (errors, environment, datasets, the shipped heads' paths).
LAYERS = [
    {
        "specdec.errors",
        "specdec.envs",
        "specdec.device_memory",
        "specdec.datasets",
        "specdec.heads",
    },
    {"specdec.models"},
    {"specdec.cpu"},
    {"specdec.speculation"},
    {"specdec.drafters"},
    {"specdec.runtime"},
    {"specdec.training", "specdec.integrations"},
    {"specdec.bench", "specdec.serve"},
    {"specdec.cli", "specdec.__main__"},
]
# imports the layer order allows but the design does not (docs: CONTRIBUTING.md, layout)
FORBIDDEN = {
    "specdec.drafters": {"specdec.speculation.policy"},  # drafters see a TreeSizer only
}


def layer_of(module: str) -> int:
    """The layer of a module of the package."""
    if module == "specdec":  # the public names, loaded lazily (only errors at import)
        return 0
    for i, units in enumerate(LAYERS):
        if any(module == u or module.startswith(u + ".") for u in units):
            return i
    raise AssertionError(f"{module} is in no layer of test_layering.LAYERS")


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
                # `from P import M`: the submodule P.M where M is one, else P itself
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [node.value]  # importlib.import_module("specdec.cli.generate")
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
    assert {
        "specdec.cli",
        "specdec.cli.generate",
        "specdec.training.eagle",
        "specdec.runtime.engine",
    } <= set(graph)
    assert "specdec.cli.generate" in graph["specdec.cli"]  # the lazy subcommands are seen
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def violations(graph) -> list:
    """The imports of graph ({module: imported modules}) that go up a layer or are forbidden."""
    found = []
    for name, deps in graph.items():
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(name):
                found.append(f"{name} imports {dep}, a higher layer")
            for unit, banned in FORBIDDEN.items():
                if (name == unit or name.startswith(unit + ".")) and dep in banned:
                    found.append(f"{name} imports {dep}")
    return found


def test_layers():
    """Every import goes to the module's own layer or one below it; the forbidden ones never."""
    assert violations(import_graph()) == []


def test_layers_catch_planted_imports():
    """The check fails on an upward import (the model importing the CPU decode path) and on a
    forbidden one (a drafter importing the adaptive policy)."""
    planted = {
        "specdec.models.llama": {"specdec.cpu.fused_layers"},
        "specdec.drafters.ngram": {"specdec.speculation.policy"},
        "specdec.cpu.fused_layers": {"specdec.models.llama"},
    }
    assert violations(planted) == [
        "specdec.models.llama imports specdec.cpu.fused_layers, a higher layer",
        "specdec.drafters.ngram imports specdec.speculation.policy",
    ]


def test_top_level_modules_are_few():
    """The package is laid out by concept: beside the subpackages, a handful of leaf modules."""
    top = [f for f in os.listdir(PACKAGE_DIR) if f.endswith(".py")]
    assert len(top) <= 6, top


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
        "print(sorted(m for m in sys.modules if m.startswith('specdec.') and m not in before))"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    at_import, after_parse = proc.stdout.splitlines()
    assert eval(at_import) == [
        "specdec",
        "specdec.cli",
        "specdec.errors",
    ]  # no torch for `specdec --help`
    assert eval(after_parse) == [  # the generate flags only: no model, engine or torch
        "specdec.cli.common",
        "specdec.cli.generate",
        "specdec.drafters",
        "specdec.drafters.choice",
        "specdec.speculation",
        "specdec.speculation.trees",
    ]


def test_module_entry_point():
    """`python -m specdec` is the `specdec` command."""
    proc = run_python("-m", "specdec", "--help")
    assert proc.returncode == 0 and "generate" in proc.stdout, (proc.stdout, proc.stderr)


def test_every_package_is_installed():
    """Each package directory of the checkout is listed in pyproject.toml, so that `pip install`
    ships it (a subpackage missing there imports from a checkout but not from an install)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

"""The package layout: no import cycles between modules (imports inside functions and type-checking imports
included), no file over 500 lines and
no function over 80; the tests
mirror it: no test file imports another (shared helpers live in the ``tests/_*.py`` helper modules)."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qat_app", "callbacks")
MAX_LINES = 500
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """Modules of ours that ``name`` imports anywhere: at module level, in ``if TYPE_CHECKING:`` blocks and inside
    functions (a deferred import still ties the two modules together: a cycle the reader has to untangle)."""
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known}
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (a package's ``__init__`` importing its own submodules is how
    packages work, not an arrow)."""
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    return {name: {t for t in targets if not (t.startswith(name + ".") and found[name].endswith("__init__.py"))}
            for name, targets in graph.items()}


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_an_import_inside_a_function_is_an_arrow_and_closes_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    graph = {name: imports_of(name, str(tmp_path / f"{name}.py"), {"a", "b"}) for name in ("a", "b")}
    assert graph == {"a": {"b"}, "b": {"a"}} and cycles_of(graph) == [["a", "b", "a"]]


def test_no_import_cycles():
    graph = import_graph()
    assert cycles_of(graph) == []
    assert graph["qat_app.hif8.backends.base"] == set()  # the contract is a leaf


def test_no_function_over_80_lines():
    """Split where a reader would name the parts (decorators not counted)."""
    long = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long[f"{os.path.relpath(path, ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_no_file_over_500_lines():
    long = {path: n for path in modules().values() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, long


TEST_MODULE = re.compile(r"^(?:tests\.)?(test_\w+)")


def reached_test_modules(path: str) -> set[str]:
    """The test modules ``path`` reaches into, other than itself: imports anywhere in the file
    (``from tests.test_x import``, ``import tests.test_x``, ``from tests import test_x``, ``from .test_x import``)
    and class paths in strings (``"tests.test_x.Callback"``, which main.py imports)."""
    own = os.path.basename(path)[:-3]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.module in (None, "tests"):  # from . import test_x / from tests import test_x
                names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tests.test_"):
            names = [node.value]
        else:
            continue
        found |= {m.group(1) for name in names if (m := TEST_MODULE.match(name))} - {own}
    return found


def test_no_test_file_imports_another():
    """Helpers shared by several test files live in helper modules (``tests/_cli_runs.py``, ``_tiny_models.py``,
    ...), so each test file runs, moves and is renamed on its own."""
    tests_dir = os.path.join(ROOT, "tests")
    files = sorted(f for f in os.listdir(tests_dir) if f.endswith(".py") and (f.startswith("test_") or f.startswith("_")))
    assert "test_layout.py" in files and "_cli_runs.py" in files
    reached = {f: reached_test_modules(os.path.join(tests_dir, f)) for f in files}
    assert {f: sorted(r) for f, r in reached.items() if r} == {}

"""The shape of the code a newcomer changes : counts in ``qat_app/`` and ``callbacks/``.

    python benchmarks/code_shape.py [ROOT]

- ``tuple_returns``: functions with a ``return`` of a literal tuple of three or more elements;
- ``long_functions``: functions over 40 lines (decorators excluded, the docstring included);
- ``callback_hasattr``: ``hasattr`` on an element of ``trainer.callbacks`` (one callback looking for another);
- ``operand_from_name``: call sites that read an operand out of a tensor, module or state name: a split (``split``,
  ``rsplit``, ``partition``, ``rpartition`` on ".") on a line naming an operand or scaler, or a call of a function
  that does (``operand_of``, ``Operand.of_tensor``, kept for names read back from files).

Each count lists its sites with ``--list``. Not a test: a measure, read before and after a change.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGES = ("qat_app", "callbacks")
SPLITS = {"split", "rsplit", "partition", "rpartition"}
OPERAND_WORDS = ("operand", "scaler", "SCALER", "OPERAND")
NAME_PARSERS = {"operand_of", "of_tensor"}  # the functions that read an operand out of a name


def python_files(root: Path):
    for package in PACKAGES:
        yield from sorted((root / package).rglob("*.py"))


def functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def own_returns(function: ast.AST):
    """The return statements of ``function`` itself, not of functions nested in it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def tuple_returns(tree):
    for f in functions(tree):
        if any(isinstance(r.value, ast.Tuple) and len(r.value.elts) >= 3 for r in own_returns(f)):
            yield f.lineno, f.name


def long_functions(tree):
    for f in functions(tree):
        if f.end_lineno - f.lineno + 1 > 40:
            yield f.lineno, f"{f.name} ({f.end_lineno - f.lineno + 1} lines)"


def callback_hasattr(tree):
    """hasattr(c, ...) where c iterates over ``<...>.callbacks``."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.For, ast.comprehension, ast.GeneratorExp, ast.ListComp, ast.SetComp)):
            continue
        loops = node.generators if hasattr(node, "generators") else [node]
        for loop in loops:
            if "callbacks" not in ast.unparse(loop.iter) or not isinstance(loop.target, ast.Name):
                continue
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "hasattr"
                        and isinstance(call.args[0], ast.Name) and call.args[0].id == loop.target.id):
                    yield call.lineno, ast.unparse(call)


def operand_from_name(tree, lines):
    """A name split on "." on a line that mentions an operand or scaler (the parsed part is the operand), or a call
    of a function that does so (:data:`NAME_PARSERS`)."""
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        line = lines[call.lineno - 1]
        called = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        if called in NAME_PARSERS or (
                called in SPLITS and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == "."
                and any(word in line for word in OPERAND_WORDS)):
            yield call.lineno, line.strip()[:100]


MEASURES = {"tuple_returns": tuple_returns, "long_functions": long_functions, "callback_hasattr": callback_hasattr,
            "operand_from_name": operand_from_name}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--list", action="store_true", help="print each site")
    args = parser.parse_args(argv)
    root = Path(args.root)
    sites = {name: [] for name in MEASURES}
    for path in python_files(root):
        source = path.read_text()
        tree, lines = ast.parse(source, filename=str(path)), source.splitlines()
        for name, measure in MEASURES.items():
            found = measure(tree, lines) if name == "operand_from_name" else measure(tree)
            sites[name] += sorted({f"{path.relative_to(root)}:{line} {what}" for line, what in found})
    for name, found in sites.items():
        print(f"{name:20s} {len(found)}")
        if args.list:
            print("".join(f"    {site}\n" for site in found), end="")


if __name__ == "__main__":
    main()

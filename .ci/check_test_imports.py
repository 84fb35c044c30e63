"""Checks that every module the tests import, at any depth (inside functions too), imports in this environment and
comes from a distribution that targetpo's own requirements name (its dependencies or its `test` extra), so that
`pip install -e ".[test]"` alone brings it and no other package's dependencies bring it by chance.

Run by .ci/run in a fresh venv holding only `pip install -e ".[test]"`. An import is left out when it is guarded, that
is when the test that reaches it is skipped where the module is missing:
- inside a `try` whose `except` catches ImportError (or ModuleNotFoundError, Exception, or everything);
- in a file that calls `pytest.importorskip` on the same package;
- in a file, class or function skipped by `pytest.importorskip` at the file's top level, or by a `skipif` (a
  decorator, a marker named at the file's top level, or `pytestmark`) or an `if` whose condition asks `find_spec`.
Imports of the tests' own modules (files in tests/) and of the standard library are not checked, nor the files in
OPTIONAL, which only tests skipped without their package load (in another process).
"""

import ast
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
OPTIONAL = {
    "tests/paced_vllm_steps.py": "a vLLM plugin that the vLLM tests' servers load; they skip without vLLM",
}


def _calls(node, name):
    """The calls under ``node`` to a function or method named ``name``."""
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", None)) == name
    ]


def _asks_find_spec(node, markers):
    """Whether ``node`` (a skipif marker, a condition, or a marker's name) skips on a module's absence."""
    if isinstance(node, ast.Name) and node.id in markers:
        return True
    return bool(_calls(node, "find_spec"))


def _catches_import_errors(handler):
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(name, "id", getattr(name, "attr", None)) in IMPORT_ERRORS for name in names)


def _module_level_guards(tree):
    """The file's skip markers that ask find_spec (by name), and whether the whole file is skipped on a missing
    module (`pytestmark` asking find_spec, or a top-level `pytest.importorskip`)."""
    markers, whole_file = set(), False
    for statement in tree.body:
        if not isinstance(statement, (ast.Assign, ast.Expr)):
            continue
        if _calls(statement, "importorskip"):
            whole_file = True
        if isinstance(statement, ast.Assign) and _calls(statement.value, "skipif"):
            if any(_asks_find_spec(call, markers) for call in _calls(statement.value, "skipif")):
                targets = [target.id for target in statement.targets if isinstance(target, ast.Name)]
                markers.update(targets)
                whole_file |= "pytestmark" in targets
    return markers, whole_file


class _Imports(ast.NodeVisitor):
    """The unguarded absolute imports of one file: (line, module, names imported from it)."""

    def __init__(self, markers):
        self.markers = markers
        self.guarded = 0
        self.found = []

    def _visit_guarded(self, guarded, nodes):
        self.guarded += guarded
        for node in nodes:
            self.visit(node)
        self.guarded -= guarded

    def _visit_scope(self, node):
        skipped = any(
            _asks_find_spec(decorator, self.markers)
            for decorator in node.decorator_list
            if isinstance(decorator, ast.Name) or _calls(decorator, "skipif")
        )
        self._visit_guarded(skipped, node.body)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def visit_Try(self, node):
        self._visit_guarded(any(_catches_import_errors(handler) for handler in node.handlers), node.body)
        for part in (node.handlers, node.orelse, node.finalbody):
            self._visit_guarded(False, part)

    def visit_If(self, node):
        self._visit_guarded(_asks_find_spec(node.test, ()), node.body)
        self._visit_guarded(False, node.orelse)

    def visit_Import(self, node):
        if not self.guarded:
            self.found += [(node.lineno, alias.name, ()) for alias in node.names]

    def visit_ImportFrom(self, node):
        if not self.guarded and node.level == 0:
            self.found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))


def unguarded_imports(path):
    tree = ast.parse(path.read_text(), str(path))
    markers, whole_file = _module_level_guards(tree)
    if whole_file:
        return []
    skipped_packages = {
        call.args[0].value.split(".")[0]
        for call in _calls(tree, "importorskip")
        if call.args and isinstance(call.args[0], ast.Constant)
    }
    visitor = _Imports(markers)
    visitor.visit(tree)
    return [found for found in visitor.found if found[1].split(".")[0] not in skipped_packages]


def _requirement_names():
    """The distributions targetpo's install with the `test` extra asks for by name, normalised."""
    names = {"targetpo"}
    for requirement in importlib.metadata.requires("targetpo") or []:
        marker = requirement.partition(";")[2]
        if not marker or re.search(r"extra\s*==\s*['\"]test['\"]", marker):
            names.add(_normalise(re.match(r"[A-Za-z0-9._-]+", requirement).group()))
    return names


def _normalise(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def problems():
    local = {path.stem for path in TESTS.rglob("*.py")}
    providers = importlib.metadata.packages_distributions()
    required = _requirement_names()
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if str(path.relative_to(TESTS.parent)) in OPTIONAL:
            continue
        for line, module, names in unguarded_imports(path):
            package = module.split(".")[0]
            if package in local or package in sys.stdlib_module_names:
                continue
            where = f"{path.relative_to(TESTS.parent)}:{line}: {module}"
            try:
                imported = importlib.import_module(module)
            except Exception as error:  # any failure to import is the finding
                found.append(f"{where} does not import: {type(error).__name__}: {error}")
                continue
            for name in names:
                if name != "*" and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError as error:
                        found.append(f"{where} has no {name}: {error}")
            distributions = {_normalise(name) for name in providers.get(package, [])}
            if not distributions & required:
                found.append(
                    f"{where} comes from {', '.join(sorted(distributions)) or 'no distribution'}, which targetpo's "
                    "requirements do not name: add it to the `test` extra in pyproject.toml, or skip the test "
                    "where it is missing (pytest.importorskip)"
                )
    return found


if __name__ == "__main__":
    found = problems()
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        sys.exit(f"{len(found)} imports in tests/ that `pip install -e \".[test]\"` does not provide")
    print("Every module the tests import comes with `pip install -e \".[test]\"`.")

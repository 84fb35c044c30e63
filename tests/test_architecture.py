"""The layering docs/architecture.md describes: each module imports, when it loads, only modules above it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "targetpo"

# The order of docs/architecture.md's module table (a package's __init__ after the modules it gathers).
LAYERS = [
    "functional",
    "step.layout",
    "config.fields",
    "config",
    "batch",
    "objectives.regularisers",
    "callbacks",
    "modeling.vision",
    "data",
    "episodes.tools",
    "generation.base",
    "generation.sampling",
    "generation.server_auth",
    "generation.kv_cache",
    "generation.transformers_backend",
    "generation",
    "episodes.multi_turn",
    "modeling.loading",
    "modeling.output_head",
    "modeling.packing",
    "modeling.shared_prompt",
    "modeling.logps",
    "distributed",
    "step.token_budget",
    "step.forward",
    "objectives.registry",
    "rewards",
    "config.preflight",
    "reporting.completions",
    "reporting.metrics",
    "reporting.run_summary",
    "rollout.prompts",
    "rollout.scheduler",
    "rollout.no_signal",
    "rollout.sources",
    "rollout.scoring",
    "step.split_groups",
    "trainer",
    "",  # targetpo/__init__.py
    "cli",
    "demo",
    "episodes",
    "generation.gloo_transfer",
    "generation.serve",
    "generation.vllm_backend",
    "generation.vllm_server",
    "modeling",
    "modeling.triton_head",
    "objectives",
    "reporting",
    "rollout",
    "step",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_load(path: Path) -> set[str]:
    """The package's own modules a file imports at its top level (``if TYPE_CHECKING:`` and function bodies aside)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)]
        if node.module:
            found.add(".".join([*base, node.module]))
        else:  # `from . import functional`
            found.update(".".join([*base, alias.name]) for alias in node.names)
    return found


def test_every_module_is_placed_in_the_layering():
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert modules == set(LAYERS), "add the module to LAYERS and to docs/architecture.md's table, in its place"


def test_each_module_imports_only_modules_above_it():
    rank = {name: place for place, name in enumerate(LAYERS)}
    upward = [
        f"{module_name(path) or 'targetpo'} imports {imported}"
        for path in PACKAGE.rglob("*.py")
        for imported in imports_at_load(path)
        if rank[imported] >= rank[module_name(path)]
    ]
    assert upward == []


def test_the_math_imports_nothing_of_ours_and_only_the_package_imports_the_trainer():
    assert imports_at_load(PACKAGE / "functional.py") == set()
    importers = {module_name(path) for path in PACKAGE.rglob("*.py") if "trainer" in imports_at_load(path)}
    assert importers == {""}

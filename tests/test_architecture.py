"""The shape docs/architecture.md describes, kept by rule: every module imports only modules below it (at load, under
``if TYPE_CHECKING:`` or inside a function alike), nothing but the trainer reads the trainer's private state, the
ground floor imports nothing of ours, and no file, class or function outgrows its size."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from targetpo.config import LOSS_TYPES

PACKAGE = Path(__file__).resolve().parents[1] / "targetpo"

# docs/architecture.md's floors, from the ground up; within a floor, a module may import those listed before it.
# A package's __init__ comes after the modules it gathers.
FLOORS = {
    "the record and the math": ["functional", "batch"],
    "settings": ["objectives.settings", "step.layout", "config.rules", "config.fields", "config"],
    "parts": [
        "objectives.regularisers",
        "callbacks",
        "generation.base",
        "modeling.vision",
        "data",
        "episodes.async_runner",
        "episodes.tools",
        "episodes.chat_template",
        "generation.sampling",
        "generation.server_auth",
        "generation.server_liveness",
        "generation.server_restarts",
        "generation.kv_cache",
        "generation.transformers_backend",
        "generation.continuous_batching",
        "distributed",
        "faults.lost_processes",
        "faults.checkpoints",
        "faults",
        "modeling.loading",
        "generation.vllm_backend",
        "generation.gloo_transfer",
        "generation.vllm_server",
        "generation",
        "generation.serve",
        "episodes.environments",
        "episodes.multi_turn",
        "episodes.parts",
        "episodes",
        "modeling.output_head",
        "modeling.packing",
        "modeling.shared_prompt",
        "modeling.triton_head",
        "modeling.logps",
        "modeling",
    ],
    "the loss": [
        "step.token_budget",
        "step.forward",
        "objectives.registry",
        "objectives",
        "rewards",
        "config.preflight",
    ],
    "reporting": ["reporting.completions", "reporting.metrics", "reporting.run_summary", "reporting"],
    "rollouts": [
        "rollout.prompts",
        "rollout.context",
        "rollout.sources",
        "rollout.scheduler",
        "rollout.no_signal",
        "rollout.scoring",
        "rollout.ahead",
        "rollout.in_progress",
        "rollout",
    ],
    "the step": ["step.plan", "step.split_groups", "step.run", "step"],
    "the trainer": ["trainer", "", "cli", "demo"],  # "": targetpo/__init__.py
}
LAYERS = [module for floor in FLOORS.values() for module in floor]

#: The sizes the house keeps (lines, def or class line to last line, docstrings included).
TRAINER_FILE_LINES, TRAINER_CLASS_LINES, FUNCTION_LINES, CLASS_LINES, CONFIG_METHOD_LINES = 500, 450, 60, 450, 120
CONFIG_CLASSES = {"GRPOConfig", "TargetPOConfig"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The package's own modules a file imports anywhere: at load, under ``if TYPE_CHECKING:``, inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(
                alias.name.removeprefix("targetpo.") for alias in node.names if alias.name.startswith("targetpo.")
            )
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:  # absolute: ``from targetpo.x import y``
            if node.module == "targetpo" or (node.module or "").startswith("targetpo."):
                found.add(node.module.removeprefix("targetpo").removeprefix("."))
            continue
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)]
        if node.module:
            found.add(".".join([*base, node.module]))
        else:  # `from . import functional`
            found.update(".".join([*base, alias.name]) for alias in node.names)
    return found


def sources() -> dict[str, str]:
    return {module_name(path): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_every_module_is_placed_on_a_floor():
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert modules == set(LAYERS), "add the module to FLOORS and to docs/architecture.md, in its place"
    assert len(LAYERS) == len(set(LAYERS))


def test_each_module_imports_only_modules_below_it_type_checking_and_function_imports_included():
    rank = {name: place for place, name in enumerate(LAYERS)}
    upward = [
        f"{module_name(path) or 'targetpo'} imports {imported}"
        for path in PACKAGE.rglob("*.py")
        for imported in imports_of(path)
        if rank[imported] >= rank[module_name(path)]
    ]
    assert upward == []


def test_the_ground_floor_imports_nothing_of_ours_and_only_the_package_imports_the_trainer():
    for module in FLOORS["the record and the math"]:
        assert imports_of(PACKAGE / f"{module.replace('.', '/')}.py") == set(), module
    importers = {module_name(path) for path in PACKAGE.rglob("*.py") if "trainer" in imports_of(path)}
    assert importers == {""}


def test_no_module_but_the_trainer_reads_its_private_state():
    reads = {
        module: re.findall(r"\btrainer\._[a-z]\w*", source)
        for module, source in sources().items()
        if module != "trainer"
    }
    assert {module: found for module, found in reads.items() if found} == {}


def _definitions(kind: type) -> list[tuple[int, str]]:
    """(lines, where) of every function or class in the package."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                found.append((node.end_lineno - node.lineno + 1, f"{module_name(path)}.{node.name}"))
    return found


def test_the_trainer_only_wires_within_its_sizes():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= TRAINER_FILE_LINES
    [trainer] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TargetPOTrainer"]
    assert trainer.end_lineno - trainer.lineno + 1 <= TRAINER_CLASS_LINES


def test_no_function_or_class_outgrows_its_size():
    functions = [f"{where}: {lines}" for lines, where in _definitions(ast.FunctionDef) if lines > FUNCTION_LINES]
    classes = [
        f"{where}: {lines}"
        for lines, where in _definitions(ast.ClassDef)
        if lines > CLASS_LINES and where.rpartition(".")[2] not in CONFIG_CLASSES
    ]
    assert functions == [] and classes == []


def test_the_config_classes_declare_more_than_they_compute():
    methods = 0
    for path in (PACKAGE / "config").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in CONFIG_CLASSES:
                methods += sum(
                    item.end_lineno - item.lineno + 1 for item in node.body if isinstance(item, ast.FunctionDef)
                )
    assert methods <= CONFIG_METHOD_LINES


def test_no_loss_name_is_compared_outside_the_objectives():
    """Loss knowledge lives in objectives/: the math's public functions that take a ``loss_type`` look it up in
    ``functional.POLICY_GRADIENT_FAMILY``, a table of each loss's pieces, and compare no name."""
    names = "|".join(LOSS_TYPES)
    pattern = re.compile(rf"loss_type\s*(==|!=|in\b|not in\b)|[=!]=\s*[\"']({names})[\"']|[\"']({names})[\"']\s*[=!]=")
    found = {
        module: len(pattern.findall(source))
        for module, source in sources().items()
        if not module.startswith("objectives.") and pattern.search(source)
    }
    assert found == {}

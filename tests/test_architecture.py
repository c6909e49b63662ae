"""The package's layout rules, read from the source with `ast` (no import runs):

- the rollout side (`rollout/`) imports nothing of the learner's, the run's or the commands'
  (`learner/`, `train/`, `experiments/`, `report/`, `cli`), so that a rollout worker carries only
  what samples;
- `learner/` is tensor maths: it does no file I/O (no file-handling module, no `open`, `save`, `load`);
- imports point down the stack: commands → one run → learner and rollout → model and tasks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sparserl"

# Each layer may import its own and any layer listed after it (rewards and tasks are leaves that
# the model-free layers share; config and errors sit at the bottom).
LAYERS = [
    {"cli"},
    {"experiments", "report", "interop"},
    {"train"},
    {"learner"},
    {"rollout"},
    {"model", "rewards", "tasks"},
    {"config", "errors"},
]
ROLLOUT_MAY_NOT_IMPORT = {"learner", "train", "experiments", "report", "cli"}
# Upward imports, each with why it exists: the config derives the KV policies' options (flags,
# defaults, help) from the policies' own dataclasses and the task names from the task registry, and
# checks schedule files with the rollout side's reader, so that each lives in one place. The list may
# only shrink: an entry that no longer happens fails too, so that it is deleted here.
KNOWN_UPWARD = {
    "config.flags": ["sparserl.rollout.kv_policies", "sparserl.tasks.registry"],
    "config.schema": ["sparserl.rollout.kv_policies", "sparserl.rollout.schedule", "sparserl.tasks.registry"],
}
IO_MODULES = {"pathlib", "json", "yaml", "safetensors", "shutil", "pickle", "tensorboard", "csv"}
IO_CALLS = {"open", "save", "load", "save_file", "load_file", "write_text", "read_text"}


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE).with_suffix("").parts): path for path in PACKAGE.rglob("*.py")}


def _imports(name: str, source: str) -> set[str]:
    """Absolute names of everything module `name` (`source`) imports, at any depth; `from X import y`
    names `X` and, when `y` is a module of the package, `X.y` too (`from .. import learner`)."""
    package = name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                target = "sparserl." + target if target else "sparserl"
            else:
                target = node.module
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names
                      if f"{target}.{alias.name}".removeprefix("sparserl.") in PACKAGE_MODULES}
    return found


# Every module and package of sparserl, as `learner.grpo`, `learner`, `cli`.
PACKAGE_MODULES = {name.removesuffix(".__init__") for name in _modules()}


def _top(name: str) -> str:
    """The first-level part of a module inside the package: `rollout`, `cli`, ..."""
    return name.split(".")[1] if name.startswith("sparserl.") else ""


def _layer(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


GRAPH = {name: _imports(name, path.read_text()) for name, path in _modules().items()}


def test_every_module_belongs_to_a_layer():
    parts = {name.split(".")[0] for name in GRAPH if name != "__init__"}
    assert parts <= set().union(*LAYERS), f"modules outside every layer: {parts - set().union(*LAYERS)}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("rollout.")))
def test_the_rollout_side_imports_nothing_of_the_learner_or_the_run(name):
    reached = {_top(target) for target in GRAPH[name]} & ROLLOUT_MAY_NOT_IMPORT
    assert not reached, f"rollout module {name} imports {reached}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("learner.")))
def test_the_learner_does_no_io(name):
    modules = {target.split(".")[0] for target in GRAPH[name]} & IO_MODULES
    assert not modules, f"{name} imports I/O modules {modules}"
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
             for node in ast.walk(ast.parse(_modules()[name].read_text())) if isinstance(node, ast.Call)}
    assert not calls & IO_CALLS, f"{name} calls {calls & IO_CALLS}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n != "__init__"))
def test_imports_point_down_the_stack(name):
    own = _layer(name.split(".")[0])
    upward = sorted(target for target in GRAPH[name] if _top(target) and _layer(_top(target)) < own)
    assert upward == KNOWN_UPWARD.get(name, []), f"{name} imports modules of a higher layer: {upward}"


def test_the_reader_sees_relative_and_absolute_imports():
    source = ("from ..train.trainer import GRPOTrainer\nfrom . import engine\nimport sparserl.learner.grpo\n"
              "from .. import cli\n")
    found = _imports("rollout.sampler", source)
    assert found == {"sparserl.train.trainer", "sparserl.rollout", "sparserl.rollout.engine", "sparserl.learner.grpo",
                     "sparserl", "sparserl.cli"}
    assert {_top(t) for t in found} & ROLLOUT_MAY_NOT_IMPORT == {"train", "learner", "cli"}

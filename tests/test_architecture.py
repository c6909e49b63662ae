"""The package's layout rules, read from the source with `ast` (no import runs):

- no cycle at any package level: among the top-level packages and modules of `sparserl`, and among the children
  of every package inside it (`rollout/`'s rooms, `dispatch/`'s modules, ...), counting `from .. import x` and
  imports inside functions; an import under `if TYPE_CHECKING:` runs nowhere and does not count;
- no cycle among the files either, and there an import under `if TYPE_CHECKING:` counts: two files that each need
  the other to be read are one room, whether the import runs or only names a type;
- imports point down the stack: commands → one run → the learner → the config → the rollout side → the model →
  rewards → tasks → errors. The config sits above the rollout side and the tasks because it derives flags from
  their registries (KV policies, tasks, dispatch backends), which live below it;
- the rollout side imports nothing of the learner's, the run's or the commands', so that a rollout worker carries
  only what samples;
- `learner/` is tensor maths: it does no file I/O (no file-handling module, no `open`, `save`, `load`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sparserl"

# Each layer may import its own and any layer listed after it.
LAYERS = [
    {"cli", "commands"},
    {"experiments", "report", "interop", "integrations"},
    {"train"},
    {"learner"},
    {"config"},
    {"rollout"},
    {"model"},
    {"rewards"},
    {"tasks"},
    {"errors"},
]
ROLLOUT_MAY_NOT_IMPORT = {"learner", "train", "experiments", "report", "cli", "commands", "config"}
IO_MODULES = {"pathlib", "json", "yaml", "safetensors", "shutil", "pickle", "tensorboard", "csv"}
IO_CALLS = {"open", "save", "load", "save_file", "load_file", "write_text", "read_text"}


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE).with_suffix("").parts): path for path in PACKAGE.rglob("*.py")}


MODULES = _modules()
# Every module and package of sparserl, as `learner.grpo`, `learner`, `cli`.
PACKAGE_MODULES = {name.removesuffix(".__init__") for name in MODULES}


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The import nodes under `if TYPE_CHECKING:`: annotations only, they never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped |= {child for statement in node.body for child in ast.walk(statement)}
    return skipped


def _imports(name: str, source: str, type_only_too: bool = False) -> set[str]:
    """Absolute names of everything module `name` (`source`) imports, at any depth; `from X import y`
    names `X` and, when `y` is a module of the package, `X.y` too (`from .. import learner`). Imports under
    `if TYPE_CHECKING:` only with `type_only_too`."""
    is_package = name.endswith(".__init__") or name == "__init__"
    package = name.split(".")[:-1]
    tree = ast.parse(source)
    skipped = set() if type_only_too else _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # In a package's __init__, `.` is the package itself; in a module, its parent package.
                base = package[: len(package) - (node.level - 1)] if not is_package or node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
                target = "sparserl." + target if target else "sparserl"
            else:
                target = node.module
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names
                      if f"{target}.{alias.name}".removeprefix("sparserl.") in PACKAGE_MODULES}
    return found


def _top(name: str) -> str:
    """The first-level part of a module inside the package: `rollout`, `cli`, ..."""
    return name.split(".")[1] if name.startswith("sparserl.") else ""


def _layer(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


GRAPH = {name: {t for t in _imports(name, path.read_text()) if t.startswith("sparserl")}
         for name, path in MODULES.items()}


def _file(target: str) -> str | None:
    """The file an imported name runs: `rollout.batch`, or a package's `__init__` (None outside sparserl)."""
    inside = target.removeprefix("sparserl").lstrip(".")
    if inside in MODULES:
        return inside
    init = f"{inside}.__init__" if inside else "__init__"
    return init if init in MODULES else None


def _file_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Edges between files (`sources`: module name -> its text), type-only imports included."""
    return {name: {f for target in _imports(name, source, type_only_too=True) if target.startswith("sparserl")
                   if (f := _file(target)) is not None and f != name}
            for name, source in sources.items()}


def _children_graph(package: str) -> dict[str, set[str]]:
    """Edges between the direct children (modules and sub-packages) of `package` ("" for sparserl itself),
    from every import of a module below one child into another child. A package's own `__init__` imports
    its children (registration lines) and is no child itself."""
    depth = len(package.split(".")) if package else 0
    prefix = package + "." if package else ""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, targets in GRAPH.items():
        if not name.startswith(prefix) or name == prefix + "__init__":
            continue
        source = name.split(".")[depth]
        for target in targets:
            inside = target.removeprefix("sparserl").lstrip(".")
            if not inside.startswith(prefix) or inside == package:
                continue
            child = inside.split(".")[depth] if len(inside.split(".")) > depth else None
            if child and child != source:
                edges[source].add(child)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the nodes along it, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


PACKAGES = sorted({"", *(name.removesuffix(".__init__") for name in MODULES if name.endswith("__init__")
                         and name != "__init__")})


def test_every_module_belongs_to_a_layer():
    parts = {name.split(".")[0] for name in GRAPH if name != "__init__"}
    assert parts <= set().union(*LAYERS), f"modules outside every layer: {parts - set().union(*LAYERS)}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p or "sparserl")
def test_no_cycle_among_the_children_of_any_package(package):
    cycle = _cycle(_children_graph(package))
    assert cycle is None, f"in {package or 'sparserl'}: {' -> '.join(cycle)}"


def test_no_cycle_among_files_type_only_imports_included():
    cycle = _cycle(_file_graph({name: path.read_text() for name, path in MODULES.items()}))
    assert cycle is None, f"files that import each other: {' -> '.join(cycle)}"


def test_the_file_graph_sees_a_cycle_made_only_of_a_type_import():
    """schema.py and validation.py imported each other this way before issue 56: the check must fail on it."""
    sources = {name: path.read_text() for name, path in MODULES.items()}
    sources["config.validation"] += "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .schema import X\n"
    assert _cycle(_file_graph(sources)) in (["config.schema", "config.validation", "config.schema"],
                                            ["config.validation", "config.schema", "config.validation"])


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("rollout.")))
def test_the_rollout_side_imports_nothing_of_the_learner_the_run_or_the_config(name):
    reached = {_top(target) for target in GRAPH[name]} & ROLLOUT_MAY_NOT_IMPORT
    assert not reached, f"rollout module {name} imports {reached}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("learner.")))
def test_the_learner_does_no_io(name):
    modules = {target.split(".")[0] for target in _imports(name, MODULES[name].read_text())} & IO_MODULES
    assert not modules, f"{name} imports I/O modules {modules}"
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
             for node in ast.walk(ast.parse(MODULES[name].read_text())) if isinstance(node, ast.Call)}
    assert not calls & IO_CALLS, f"{name} calls {calls & IO_CALLS}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n != "__init__"))
def test_imports_point_down_the_stack(name):
    own = _layer(name.split(".")[0])
    upward = sorted(target for target in GRAPH[name] if _top(target) and _layer(_top(target)) < own)
    assert not upward, f"{name} imports modules of a higher layer: {upward}"


def test_the_reader_sees_every_kind_of_import():
    source = ("from ..train.trainer import GRPOTrainer\nfrom . import engine\nimport sparserl.learner.grpo\n"
              "from .. import cli\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..learner import alpha\n"
              "def late():\n    from ..config import schema\n")
    found = _imports("rollout.sampler", source)
    assert found == {"sparserl.train.trainer", "sparserl.rollout", "sparserl.rollout.engine", "sparserl.learner.grpo",
                     "sparserl", "sparserl.cli", "typing", "sparserl.config", "sparserl.config.schema"}
    assert _imports("rollout.dispatch.__init__", "from . import local\n") == {"sparserl.rollout.dispatch",
                                                                              "sparserl.rollout.dispatch.local"}


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}}) is None

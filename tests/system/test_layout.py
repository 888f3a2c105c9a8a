"""The package's layout: imports run one way (no module imports, even inside a function, a module that imports it
back), so that every module can be read, tested and changed with only the modules below it in mind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import loramcl

PACKAGE = Path(loramcl.__file__).parent


def module_imports() -> dict[str, set[str]]:
    """{module: the loramcl modules it imports anywhere in its file} for every module of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("loramcl", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("loramcl"):
                # `from loramcl.analysis import language` imports the submodule, `... import embed` the package
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("loramcl")}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module."""
    order, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(node: str) -> None:
        order[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        for other in graph[node]:
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            component = []
            while (other := stack.pop()) != node:
                component.append(other)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_module_that_imports_it():
    graph = module_imports()
    assert "loramcl.mcl.copies" in graph["loramcl.mcl.model"]  # the walk sees the package
    assert cycles(graph) == []


TASKS = ("markov", "bilingual", "translation", "audio_captioning", "image_captioning", "spoken_translation")


def task(module: str) -> str | None:
    """The task a module belongs to (loramcl.recipes.<task>...), None for any other module."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "recipes" and parts[2] in TASKS else None


def test_a_task_recipe_imports_no_other_task():
    """What two recipes share lives in the shared runner (loramcl.recipes.*), data/, analysis/ or below, not inside a
    sibling task's folder."""
    sideways = sorted((name, other) for name, imports in module_imports().items() for other in imports
                      if task(name) and task(other) and task(name) != task(other))
    assert sideways == []


# The floors of the house, top first, as folders: a module imports only modules of its floor or below
# (docs/architecture.md). The top floor holds the two public faces: the package (`from loramcl import ...`) and the
# command line.
FLOORS = (("the public faces", ("loramcl", "loramcl.cli")),
          ("the recipes: the shared runner, then one folder per task", ("loramcl.recipes",)),
          ("training", ("loramcl.training",)),
          ("decoding, metrics, analysis, the models loaded (with load_mcl_model)",
           ("loramcl.decoding", "loramcl.metrics", "loramcl.analysis", "loramcl.models")),
          ("the baselines: methods built on the MCL model", ("loramcl.baselines",)),
          ("the method and the generic data readers", ("loramcl.mcl", "loramcl.data")),
          ("utilities", ("loramcl.utils",)))


def floor(module: str) -> int:
    """1 for the public faces, ..., len(FLOORS) for the utilities; a module no floor holds has none (an error)."""
    for number, (_, prefixes) in enumerate(FLOORS, start=1):
        if module in prefixes or any(module.startswith(p + ".") for p in prefixes if p != "loramcl"):
            return number
    raise AssertionError(f"{module} lies on no floor of test_layout.py's FLOORS: put it in one of their folders")


def test_every_module_lies_on_a_floor():
    assert [floor(module) for module in module_imports()]  # floor() raises for a module outside every folder
    assert floor("loramcl.cli") < floor("loramcl.recipes.audio_captioning.reproduce") \
        == floor("loramcl.recipes.runner") < floor("loramcl.training.trainer") < floor("loramcl.decoding.strategies") \
        == floor("loramcl.models.mcl") < floor("loramcl.baselines.moe") < floor("loramcl.mcl.model") \
        < floor("loramcl.utils.files")


def test_imports_run_down_the_floors():
    """utils <- mcl, data <- baselines <- decoding, metrics, analysis, models <- training <- recipes <- cli: nothing
    below imports what stands above it (load_mcl_model, in models/, imports the baselines it loads)."""
    upward = sorted((name, other) for name, imports in module_imports().items() for other in imports
                    if floor(other) < floor(name))
    assert upward == []


def test_the_top_level_holds_only_the_public_faces_and_the_folders():
    """A module of its own on the top level is a floor nobody named: put it in the folder of its role."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "cli.py"]


@pytest.mark.parametrize("root", [PACKAGE, PACKAGE.parents[1] / "benchmarks"], ids=["package", "benchmarks"])
def test_every_file_and_class_stays_readable_in_one_sitting(root):
    """No module of the package (or of benchmarks/, issue 62) over 600 lines, no class over 400 (issue 25): past that,
    a file holds more than one purpose and should be split along its seams."""
    too_long = []
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 600:
            too_long.append((str(path.relative_to(root)), text.count("\n")))
        too_long += [(f"{path.relative_to(root)}:{node.name}", node.end_lineno - node.lineno + 1)
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400]
    assert too_long == []


# Files an issue holds to a tighter limit than 600 lines, so that the next capability finds room: {path: lines}.
# Issue 62 made room in these for the next method: mcl/model.py holds the forward and the routing only (building and
# loading live apart), training/trainer.py the Trainer's hooks (the step, its settings, logs, collator and clipping
# live apart).
TIGHTER_LIMITS = {"mcl/model.py": 450, "training/trainer.py": 350}
TIGHTER_CLASS_LIMITS = {("training/trainer.py", "MCLTrainer"): 250}


def test_the_files_an_issue_made_room_in_stay_within_its_limit():
    lines = {name: (PACKAGE / name).read_text(encoding="utf-8").count("\n") for name in TIGHTER_LIMITS}
    assert {name: count for name, count in lines.items() if count > TIGHTER_LIMITS[name]} == {}
    for (name, cls), limit in TIGHTER_CLASS_LIMITS.items():
        (node,) = [node for node in ast.walk(ast.parse((PACKAGE / name).read_text(encoding="utf-8")))
                   if isinstance(node, ast.ClassDef) and node.name == cls]
        assert node.end_lineno - node.lineno + 1 <= limit, (name, cls, node.end_lineno - node.lineno + 1)


def test_no_file_of_the_package_cites_design_decisions():
    """Comments and docstrings cite what a reader of the repository can open (a docs/architecture.md section by its
    heading), not the numbered decisions of a design note outside it (issue 62)."""
    citing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*") if path.is_file()
                    and "DESIGN decision" in path.read_bytes().decode("utf-8", errors="ignore"))
    assert citing == []


def _called(function: ast.expr) -> str | None:
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)


def test_the_method_names_no_module_above_it_in_a_string():
    """mcl/ loads nothing of a floor above through importlib (`import_module`, `__import__`, `find_spec`) and holds
    no module name of one in a string: such an import is upward and the import graph cannot see it. A method built on
    MCLModel registers its loader instead (loramcl.mcl.methods, the baselines from loramcl/baselines/__init__.py,
    PEFT's `register_peft_method` shape, issue 62); importlib stays for upstream packages (importlib.metadata).
    The loader that asks the registry stands above the baselines and imports them: an import the graph sees."""
    modules = module_imports()
    assert "loramcl.baselines" in modules["loramcl.models.mcl"]
    named = []
    for path in sorted((PACKAGE / "mcl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _called(node.func) in ("import_module", "__import__", "find_spec"):
                argument = node.args[0] if node.args else None
                name = argument.value if isinstance(argument, ast.Constant) else None
                if not isinstance(name, str) or name.split(".")[0] == "loramcl":  # a computed name may be anything
                    named.append((path.name, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                module = node.value.partition(":")[0]
                if module in modules and floor(module) < floor("loramcl.mcl"):
                    named.append((path.name, node.lineno, node.value))
    assert named == []

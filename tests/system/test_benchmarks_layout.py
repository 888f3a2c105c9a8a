"""benchmarks/ in rooms (issue 62): every script in the room of its role, what the scripts share at the top, and no
script that edits ``sys.path`` (they run as modules from the repository root, and the tests import them the same way).
Each file stays readable in one sitting as the package's do (tests/system/test_layout.py)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ROOMS = ("speed", "checks", "studies")  # measurements; fault injection and the GPU check; studies that train
SHARED = ["__init__.py", "common.py", "tiny.py"]  # what every room imports, as benchmarks.common, benchmarks.tiny
DATA = {"studies": ["records"]}  # folders of data, no script: the runs a study keeps (budget_study --record)


def test_every_script_lives_in_a_room():
    top = sorted(p.name for p in BENCHMARKS.iterdir() if p.name != "__pycache__")
    assert top == sorted([*ROOMS, *SHARED])
    for room in ROOMS:
        assert (BENCHMARKS / room / "__init__.py").is_file(), f"benchmarks/{room} is no package: `python -m` fails"
        folders = [p.name for p in (BENCHMARKS / room).iterdir() if p.is_dir() and p.name != "__pycache__"]
        assert folders == DATA.get(room, [])
        for folder in folders:
            assert not [p for p in (BENCHMARKS / room / folder).rglob("*") if p.suffix in (".py", ".sh")]


def test_no_script_edits_sys_path():
    """A script finds the shared code and the other scripts as ``benchmarks.*`` (run with ``python -m`` from the
    repository root), not by putting a folder (its own, tests/) on ``sys.path``."""
    editing = sorted(str(path.relative_to(BENCHMARKS)) for path in BENCHMARKS.rglob("*")
                     if path.suffix in (".py", ".sh") and "sys.path" in path.read_text(encoding="utf-8"))
    assert editing == []


def test_scripts_import_each_other_as_modules_of_the_package():
    """``from common import ...`` worked only with a script's own folder on the path: every import of another
    benchmark module names it from ``benchmarks``."""
    names = {p.stem for p in BENCHMARKS.rglob("*.py") if p.stem != "__init__"}
    bare = []
    for path in BENCHMARKS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bare += [(path.name, node.lineno, m) for m in modules if m.split(".")[0] in names]
    assert bare == []

"""The layers of docs/architecture.md: dependencies point one way, function-level imports included.

1. core (`farm.core`) imports nothing of the farm above it;
2. `db` and `workers` import only the core (and themselves);
3. `scheduler` imports those;
4. the user-facing layer (the rest of `farm`, and `deploy`) may import everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("farm", "db", "workers", "scheduler", "deploy")
# What each layer may import, besides itself.
ALLOWED = {
    "core": {"core"},
    "db": {"core", "db"},
    "workers": {"core", "workers"},
    "scheduler": {"core", "db", "workers", "scheduler"},
    "user": {"core", "db", "workers", "scheduler", "user"},
}


def layer(module: str) -> str | None:
    """The layer of a farm module name; None for modules that are not the farm's."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if module == "farm.core" or module.startswith("farm.core."):
        return "core"
    if top in ("db", "workers", "scheduler"):
        return top
    return "user"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, at any depth of its code (function bodies included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path) -> None:
    own = layer(module_name(path))
    assert own is not None
    wrong = [f"line {line}: {name} ({layer(name)})" for line, name in imports(path)
             if layer(name) is not None and layer(name) not in ALLOWED[own]]
    assert not wrong, f"{path.relative_to(ROOT)} is in layer {own} and imports above it: {wrong}"


def test_the_layer_check_sees_function_level_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from scheduler.service import Scheduler\n    return Scheduler\n")
    assert (2, "scheduler.service") in imports(bad)


ABOVE_STORAGE = ("scheduler", "workers", "deploy", "ray", "tvm", "farm.client", "farm.export", "farm.cli",
                 "farm.apply", "farm.report")
ABOVE_CORE = ("db", "scheduler", "workers", "deploy", "ray", "farm.client", "farm.export", "farm.cli")


@pytest.mark.parametrize(("imported", "forbidden"), [
    ("db, db.store, db.base, db.sql_store, db.migrate", ABOVE_STORAGE),
    ("farm.core.task, farm.core.search, farm.core.costmodel, farm.core.jobspec", ABOVE_CORE),
])
def test_importing_a_layer_loads_nothing_above_it(imported: str, forbidden: tuple[str, ...]) -> None:
    code = (f"import sys, {imported}; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r} or m in {forbidden!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout

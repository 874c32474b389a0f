"""Imports go one way: api → core ← operator, and jobs → core's records only. Core (the spec, the planner,
the runtime-config builder, pools, names, the cluster client) imports nothing else of ours; the API and the
operator never import each other; the runtime is reached through a process (`python -m tunewright_jobs...`)
and its files, and shares only the telemetry records' definitions."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"tunewright_core": ROOT / "core", "tunewright_jobs": ROOT / "jobs",
            "tunewright_operator": ROOT / "operator", "tunewright_api": ROOT / "api"}
# what each package may import of the others (prefixes of module names)
ALLOWED = {
    "tunewright_core": (),
    "tunewright_jobs": ("tunewright_core.records",),
    "tunewright_operator": ("tunewright_core",),
    "tunewright_api": ("tunewright_core",),
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_cross_boundaries_only_where_allowed(package):
    others = tuple(p for p in PACKAGES if p != package)
    crossings = []
    for path in sorted((PACKAGES[package] / package).rglob("*.py")):
        for line, module in imports_of(path):
            if module.startswith(others) and not module.startswith(ALLOWED[package]):
                crossings.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert crossings == []


def test_the_records_the_runtime_shares_import_nothing_else_of_ours():
    """The runtime imports core's records only, and they import nothing else of ours (pydantic alone)."""
    ours = [m for _, m in imports_of(ROOT / "core" / "tunewright_core" / "records.py") if m.startswith("tunewright")]
    assert ours == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    offender = tmp_path / "offender.py"
    offender.write_text("import os\nfrom tunewright_api.models import Job\nimport tunewright_core.planner\n")
    assert imports_of(offender) == [(1, "os"), (2, "tunewright_api.models"), (3, "tunewright_core.planner")]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports(package):
    """A renamed name that a rarely run module (the demo, a benchmark helper) still imports fails here."""
    root = PACKAGES[package]
    for path in sorted((root / package).rglob("*.py")):
        if path.name != "__main__.py" and "migrations" not in path.parts:
            importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"))

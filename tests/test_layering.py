"""Dependencies flow one way: each package imports only the packages below it (anywhere in a module,
inside functions too), no test module is imported by another module, benchmarks start nothing with the
tests' launchers, and the DAGs wire nothing but the loop's Airflow tasks."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Bottom to top. A package may import itself and any package before it in this list.
LAYERS = ["settings", "capture", "traffic", "headspec", "targets", "adapt", "serving", "evaluation", "rollout", "loop",
          "app"]


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def upward(pkg_dirs: list[Path]) -> list[str]:
    bad = []
    for d in pkg_dirs:
        level = LAYERS.index(d.name)
        for f in sorted(d.rglob("*.py")):
            for line, mod in imports(f):
                top = mod.split(".")[0]
                if top in LAYERS and LAYERS.index(top) > level:
                    bad.append(f"{f.relative_to(REPO)}:{line} ({d.name}) imports {mod} (layer {top})")
    return bad


def test_no_package_imports_one_above_it():
    assert {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} - {"tests"} == set(LAYERS)
    assert upward([REPO / p for p in LAYERS]) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "capture"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from loop.cycle import run_cycle\n    return run_cycle\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert upward([pkg]) == ["capture/x.py:2 (capture) imports loop.cycle (layer loop)",
                                 "capture/x.py:2 (capture) imports loop.cycle.run_cycle (layer loop)"]
    finally:
        REPO = saved


def test_no_test_module_is_imported_and_benchmarks_launch_nothing_of_the_tests():
    """Shared test code lives in support modules (tests/*_support.py, tests/services.py), never in a test
    module; benchmarks start servers with the product's own launchers, not the tests' (tests.services)."""
    bad = []
    for f in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]):
        for line, mod in imports(f):
            parts = mod.split(".")
            if parts[0] != "tests":
                continue
            if any(p.startswith("test_") or p == "conftest" for p in parts[1:]) or (
                    f.parts[-2] == "benchmarks" and parts[1:2] == ["services"]):
                bad.append(f"{f.relative_to(REPO)}:{line} imports {mod}")
    assert bad == []


def test_dags_only_wire_the_loops_airflow_tasks():
    for f in (REPO / "dags").glob("*.py"):
        ours = {m.split(".")[0] for _, m in imports(f)} & set(LAYERS)
        assert ours <= {"loop"}, (f.name, ours)


def test_tests_are_laid_out_by_package():
    """A test module lives in the directory of the package it tests (tests/deploy for docker/ and dags/);
    only this whole-tree check sits at the top, beside the support modules."""
    tests = REPO / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_layering.py"], top
    dirs = {p.parent.relative_to(tests).parts[0] for p in tests.rglob("test_*.py") if p.parent != tests}
    assert dirs <= set(LAYERS) | {"deploy"}, dirs
    for d in dirs:
        assert (tests / d / "__init__.py").is_file(), d

"""No name that pytest makes importable from `tests/` may shadow an installed module.

pytest (prepend import mode) puts on `sys.path` the first folder above each test file that is not a package,
so every folder and module directly inside such a folder becomes a top-level import name. A test folder named
like a library (`tests/kernels/` beside Hugging Face's `kernels`) then replaces that library for every import
in the test process, transformers' own included.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def import_roots(tests: Path) -> set[Path]:
    """The folders pytest inserts into sys.path for the test files and conftests under `tests`."""
    roots = set()
    for f in list(tests.rglob("test_*.py")) + list(tests.rglob("conftest.py")):
        d = f.parent
        while (d / "__init__.py").exists():
            d = d.parent
        roots.add(d)
    return roots


def top_level_names(root: Path) -> set[str]:
    names = set()
    for p in root.iterdir():
        if p.name.startswith((".", "_")):
            continue
        if p.is_dir():
            names.add(p.name)
        elif p.suffix == ".py":
            names.add(p.stem)
    return names


def shadowed(tests: Path, search_path: list[str]) -> list[str]:
    """'tests/x shadows y' for each name importable from `tests` that `search_path` also provides."""
    found = []
    for root in sorted(import_roots(tests)):
        for name in sorted(top_level_names(root)):
            spec = importlib.machinery.PathFinder.find_spec(name, search_path)
            if spec is not None:
                where = spec.origin or list(spec.submodule_search_locations or [])
                found.append(f"{(root / name).relative_to(tests.parent)} shadows the installed '{name}' ({where})")
    return found


def installed_path() -> list[str]:
    """sys.path without the working folder, the repository and the folders pytest added for tests/."""
    repo = TESTS.parent
    return [p for p in sys.path if p and Path(p).resolve() != repo and not Path(p).resolve().is_relative_to(TESTS)]


def test_no_test_folder_or_module_shadows_an_installed_module():
    assert shadowed(TESTS, installed_path()) == []


def test_the_check_finds_a_shadowing_test_package(tmp_path):
    tests = tmp_path / "tests"
    (tests / "kernels").mkdir(parents=True)
    (tests / "kernels" / "__init__.py").write_text("")
    (tests / "kernels" / "test_ops.py").write_text("")
    (tests / "conftest.py").write_text("")
    site = tmp_path / "site-packages"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
    assert shadowed(tests, [str(site)]) == [
        f"tests/kernels shadows the installed 'kernels' ({site / 'kernels' / '__init__.py'})"]
    (tests / "kernels").rename(tests / "kernel_ops")
    assert shadowed(tests, [str(site)]) == []

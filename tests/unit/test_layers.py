"""The direction of imports is a test: the import-linter contracts in pyproject.toml hold.

The contracts: cli -> train -> reporting -> (memory, techniques, distributed) -> (models, data) -> the core
modules (config, config_loading, units, errors, gpus, hardware, checkpoint_files); techniques import neither
memory nor distributed; memory and distributed are independent; no cycle between packages at any depth.
`make lint` runs the same check. A grimp check adds what the contracts cannot see: a cycle through a
package's own __init__.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("importlinter", reason="import-linter comes with the dev extra: pip install -e '.[dev]'")


def _lint_imports(cwd: Path, source: Path) -> subprocess.CompletedProcess:
    """lint-imports on the package found under `source`, with the contracts of `cwd`/pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())", "--no-cache"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    result = _lint_imports(ROOT, ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package with `line` appended to `module` (a path under src/memfit)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src" / "memfit", tmp_path / "src" / "memfit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "corpus"))
    with (tmp_path / "src" / "memfit" / module).open("a") as file:
        file.write(f"\n{line}\n")
    return tmp_path / "src"


@pytest.mark.parametrize(
    "module, line, expected",
    [
        # an upward import: the low core reaching into the training loop
        ("units.py", "import memfit.train.loop", "memfit.units is not allowed to import memfit.train"),
        # a technique reaching into memory, which sits beside it
        ("techniques/loss.py", "import memfit.prediction.estimator", "memfit.techniques.loss -> memfit.prediction.estimator"),
        # two files importing each other (collate already imports windows)
        ("data/windows.py", "import memfit.data.collate", "No cycles are allowed in memfit.data."),
    ],
)
def test_a_forbidden_import_breaks_the_contracts(tmp_path, module, line, expected):
    """The check can fail: the same contracts on a copy of the package with one bad import added."""
    result = _lint_imports(tmp_path, _copy_with(tmp_path, module, line))
    assert result.returncode != 0, result.stdout
    assert expected in result.stdout, result.stdout


# The package's own __init__ imports these lazily, when a user asks for train/estimate/plan (as in pyproject.toml).
FACADE_PREFIXES = ("memfit.train", "memfit.memory")


def _file_cycles(graph) -> list[str]:
    """One chain per import that closes a cycle, e.g. 'a -> b -> a'."""
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain:
                cycles.append(" -> ".join((module, *chain)))
    return cycles


def _graph():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("memfit", cache_dir=None)
    for imported in list(graph.find_modules_directly_imported_by("memfit")):
        if imported.startswith(FACADE_PREFIXES):
            graph.remove_import(importer="memfit", imported=imported)
    return graph


def test_no_cycle_between_files_package_inits_included():
    assert _file_cycles(_graph()) == []


def test_a_cycle_between_files_is_found():
    graph = _graph()
    graph.add_import(importer="memfit.errors", imported="memfit.config")  # config imports errors
    assert "memfit.errors -> memfit.config -> memfit.errors" in _file_cycles(graph)

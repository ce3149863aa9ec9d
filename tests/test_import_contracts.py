"""The import order of the rooms (pyproject.toml's import-linter contracts, described in
docs/architecture.md) holds, and the contracts do bite: the same check on a scratch copy
with one import that runs the wrong way fails and names it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("testbed", "sim", "real")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the packages under ``root`` (found there first), with ``root``'s
    pyproject.toml."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_every_import_contract_is_kept():
    pytest.importorskip("importlinter")
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and out.stdout.count("KEPT") == 5


@pytest.mark.parametrize("module, bad_import, contract", [
    ("testbed/core/units.py", "import testbed.policy.router", "testbed's rooms"),
    ("testbed/policy/router.py", "import sim.backend", "testbed imports neither backend"),
    ("sim/hardware/compute.py", "import sim.step.phases", "sim's rooms"),
    ("real/kernels/adam.py", "import real.rank.worker", "real's rooms"),
    ("sim/network/network.py", "import real.comm.collectives", "the backends never import each other"),
])
def test_a_wrong_import_in_a_scratch_copy_breaks_its_contract(tmp_path, module, bad_import, contract):
    pytest.importorskip("importlinter")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{bad_import}  # the wrong way\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    broken = [line for line in out.stdout.splitlines() if line.endswith("BROKEN")]
    # the contract it breaks (an import of a backend from a policy also reaches testbed's
    # higher rooms through the backend, so more than one contract may break)
    assert any(line.startswith(contract) for line in broken), out.stdout
    assert module.removesuffix(".py").replace("/", ".") in out.stdout


def test_the_architecture_pages_room_table_counts_each_rooms_modules():
    """docs/architecture.md's table of rooms names every room, each with its number of
    modules (files of its folder besides ``__init__.py``), so the page cannot go stale."""
    import re

    rows = re.findall(r"^\| `(\w+/\w+)` \| .* \| (\d+) \|$", (REPO / "docs" / "architecture.md").read_text(), re.M)
    listed = {room: int(n) for room, n in rows}
    rooms = {f"{p.parent.parent.name}/{p.parent.name}" for package in PACKAGES
             for p in (REPO / package).glob("*/__init__.py")}
    assert set(listed) == rooms
    for room, n in listed.items():
        modules = [p for p in (REPO / room).glob("*.py") if p.name != "__init__.py"]
        assert len(modules) == n, f"{room}: {len(modules)} modules, the page says {n}"

"""What pyproject.toml promises a new user holds for the code as written."""

import ast
import re
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: standard-library modules the project may import, with the first Python that has them
STDLIB_SINCE = {"tomllib": (3, 11)}


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_requires_python_admits_no_version_without_a_module_the_code_imports():
    spec = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip()).groups())
    used = set()
    for pkg in ("testbed", "sim", "real", "experiments", "benchmarks"):
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            used |= imported_modules(path)
    for module, since in STDLIB_SINCE.items():
        if module in used:
            assert floor >= since, f"requires-python {spec} but the code imports {module} (Python {since[0]}.{since[1]}+)"

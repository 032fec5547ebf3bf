"""policies/ is pure: standard library only, and never the I/O shell."""

import ast
import sys
from pathlib import Path

import pytest

POLICIES = Path(__file__).parents[2] / "policies"
FORBIDDEN = {"asyncio", "anyio", "time", "random", "socket", "threading", "gateway"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_policy_modules_import_only_the_standard_library_and_policies(module):
    allowed = sys.stdlib_module_names | {"policies", "__future__"}
    imported = imported_modules(module)
    assert imported <= allowed, f"{module.name} imports {sorted(imported - allowed)}"
    assert not imported & FORBIDDEN, f"{module.name} imports {sorted(imported & FORBIDDEN)}"


@pytest.mark.parametrize("module", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_policy_modules_say_what_question_they_answer(module):
    docstring = ast.get_docstring(ast.parse(module.read_text()))
    assert docstring, f"{module.name} has no module docstring"

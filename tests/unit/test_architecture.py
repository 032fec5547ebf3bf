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


# -- the shell's rooms import one way ----------------------------------------------------------------

GATEWAY = Path(__file__).parents[2] / "gateway"
MAX_SHELL_LINES = 400

# Higher imports lower, never the other way. The programs assemble and run the rest; the beside
# rooms are libraries the request path uses and never call back into it.
PROGRAMS = 4  # programs (app, runtime, cli), __main__, server, tools
LAYERS = {
    "gateway.http": 3,
    "gateway.grpc": 3,
    "gateway.flow": 2,
    "gateway.queues": 1,
    **{
        f"gateway.{room}": 0
        for room in (
            "upstream",
            "telemetry",
            "signals",
            "settings",
            "supervision",
            "errors",
            "tensors",
            "fields",
            "version",
        )
    },
}


def module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int:
    return LAYERS.get(room_of(module), PROGRAMS)


def gateway_imports(path: Path) -> set[str]:
    """Every gateway module `path` imports, TYPE_CHECKING imports included (a cycle in types is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gateway."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("gateway."):
                found.add(node.module)
    return found


def back_edges() -> set[tuple[str, str]]:
    edges: set[tuple[str, str]] = set()
    for path in sorted(GATEWAY.rglob("*.py")):
        importer = module_name(path)
        for imported in gateway_imports(path):
            if room_of(imported) == room_of(importer):
                continue
            if layer_of(imported) > layer_of(importer):
                edges.add((importer, imported))
    return edges


def test_the_shell_imports_one_way_http_flow_queues_with_libraries_beside():
    found = sorted(back_edges())
    assert not found, "back-edges: " + ", ".join(f"{a} -> {b}" for a, b in found)


@pytest.mark.parametrize("module", sorted(GATEWAY.rglob("*.py")), ids=lambda p: str(p.relative_to(GATEWAY)))
def test_shell_modules_stay_small(module):
    relative = str(module.relative_to(GATEWAY))
    lines = len(module.read_text().splitlines())
    assert lines <= MAX_SHELL_LINES, f"gateway/{relative} has {lines} lines (at most {MAX_SHELL_LINES})"


def test_the_two_ingresses_share_only_what_lies_below_them():
    """HTTP and gRPC are sibling ingresses over one admission: neither imports the other."""
    crossing = []
    for path in sorted(GATEWAY.rglob("*.py")):
        importer = room_of(module_name(path))
        if importer in ("gateway.http", "gateway.grpc"):
            crossing += [
                f"{module_name(path)} -> {imported}"
                for imported in gateway_imports(path)
                if room_of(imported) in ("gateway.http", "gateway.grpc") and room_of(imported) != importer
            ]
    assert not crossing, ", ".join(crossing)

"""The layers the code is built in, checked on its imports (every one, lazy and TYPE_CHECKING ones too),
and the size of its files:

- the engine stands on the ground: no engine module imports specpool.common, grpc, protobuf or the
  generated stubs (specpool/common/speculation.py maps the engine's Method to the wire, not the reverse);
- no service imports the CLI (specpool/cli.py is the top: it imports services, never the other way);
- the drafters import one another without a circle;
- a file over 400 lines says why in a first line of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Installed as specpool.<dir> (pyproject.toml's package-dir); specpool/ itself holds the CLI and common.
PACKAGES = ["engine", "router", "cluster", "bench", "training", "target_service", "spec_endpoint", "specpool"]
NOT_IN_THE_ENGINE = ("specpool.common", "grpc", "google.protobuf", "specpool_client")


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every package file of the project."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts if package == "specpool" else ("specpool", *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module a file imports, as written, plus `module.name` for each `from module import name`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_engine_module_imports_the_services_plumbing_or_the_wire():
    wrong = {name: sorted(i for i in imports(path) if any(under(i, p) for p in NOT_IN_THE_ENGINE))
             for name, path in modules().items() if under(name, "specpool.engine")}
    assert not {name: found for name, found in wrong.items() if found}


def test_no_service_imports_the_cli():
    wrong = {name: sorted(i for i in imports(path) if under(i, "specpool.cli"))
             for name, path in modules().items() if name != "specpool.cli"}
    assert not {name: found for name, found in wrong.items() if found}


def test_the_drafters_import_one_another_without_a_circle():
    drafters = {name: path for name, path in modules().items() if under(name, "specpool.engine.drafters")}
    graph = {name: {i for i in imports(path) if i in drafters and i != name} for name, path in drafters.items()}

    def circle_from(start: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return [*path, start]
            if nxt not in path:
                found = circle_from(start, [*path, nxt])
                if found:
                    return found
        return None

    circles = [c for c in (circle_from(name, [name]) for name in sorted(graph)) if c]
    assert not circles, " -> ".join(circles[0])


def test_a_file_over_400_lines_says_why_at_its_top():
    files = [*REPO.glob("tests/**/*.py"), *modules().values(), *REPO.glob("scripts/*.py")]
    silent = sorted(str(p.relative_to(REPO)) for p in files
                    if len(p.read_text().splitlines()) > 400 and not p.read_text().startswith("# Over 400 lines: "))
    assert not silent

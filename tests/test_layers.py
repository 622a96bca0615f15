"""The import graph keeps dew's layers apart.

* ``dew.core`` imports nothing else of dew: every layer can use it;
* ``dew._attention`` (torch mask plumbing) and ``dew._net`` (socket binding) import
  nothing of dew;
* engines (``dew.serving``), sources (``dew.objectives.rl.sources``) and the gateway
  (``dew.gateway``) import only the core and themselves, never each other.

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` too:
a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# package -> the packages its modules may import (itself always included)
RULES: dict[str, tuple[str, ...]] = {
    "dew.core": (),
    # dew._attention: the attention-mask plumbing the engine and the trainer's packed
    # forward share; a floor-1 utility that imports nothing of dew either.
    # dew._watchdog ends a launched server whose trainer died; dew._runlock holds a
    # folder for one process: floor-1 utilities that import nothing of dew either.
    "dew.serving": ("dew.core", "dew._attention", "dew._watchdog", "dew._runlock"),
    "dew._watchdog": (),
    "dew._runlock": (),
    "dew._attention": (),
    # dew._net: binding a listening socket, for the HTTP servers of both layers.
    "dew._net": (),
    "dew.objectives.rl.sources": ("dew.core",),
    "dew.gateway": ("dew.core", "dew._net"),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every module a file's import statements name (relative ones resolved)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            found.add(stem)
            # `from dew import gateway` names the module dew.gateway.
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(files: Iterable[tuple[str, bool, str]]) -> list[str]:
    """``(module, is_package, source)`` triples -> one line per forbidden import."""
    out = []
    for module, is_package, source in files:
        layer = next((p for p in RULES if within(module, p)), None)
        if layer is None:
            continue
        allowed = (layer, *RULES[layer])
        for name in sorted(imports(source, module, is_package)):
            if not within(name, "dew") or name == "dew":
                continue
            if not any(within(name, a) for a in allowed):
                # `from dew.core import X` also yields dew.core.X, which is allowed;
                # a name beside an allowed package is what the rule forbids.
                out.append(f"{module} imports {name}")
    return out


def tree() -> list[tuple[str, bool, str]]:
    return [
        (module_name(p, SRC), p.name == "__init__.py", p.read_text())
        for p in sorted((SRC / "dew").rglob("*.py"))
    ]


def test_every_layer_package_exists() -> None:
    names = {m for m, _, _ in tree()}
    for package in RULES:
        assert package in names, f"{package} is missing; update RULES with the layout"


def test_layers_import_only_what_they_may() -> None:
    assert violations(tree()) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("dew.core.types", "import dew.serving\n"),
        ("dew.core.types", "from dew.objectives.rl import sessions\n"),
        ("dew.serving.server", "from dew.objectives.rl.sources import PromptSource\n"),
        ("dew.serving.server", "def f():\n    from dew.gateway import RecordingGateway\n"),
        ("dew.objectives.rl.sources.prompts", "from dew.serving import RolloutServer\n"),
        ("dew.objectives.rl.sources.prompts", "from dew import gateway\n"),
        ("dew.gateway._app", "from ..serving import RolloutServer\n"),
        ("dew.gateway._app", "from dew.objectives.rl.sessions import Call\n"),
    ],
)
def test_the_check_catches_a_crossing(module: str, source: str) -> None:
    assert violations([(module, False, source)]) != []


def test_the_check_allows_the_core_and_the_layer_itself() -> None:
    ok = "from dew.core import Call\nfrom . import _kv\nimport dew.serving._requests\n"
    assert violations([("dew.serving.server", False, ok)]) == []

"""The import graph keeps dew's layers apart.

Every module under ``src/dew`` belongs to a layer: a package of ``FLOORS`` (the first
that contains it, so ``dew.objectives.rl.sources`` before ``dew.objectives``) or a
floor-1 utility (``UTILITIES``: the root ``dew``, which holds only ``__version__``, the
top-level private modules ``dew._x``, and ``dew.data`` and ``dew.plot``). Three checks:

* floors: a module imports its own layer, any floor-1 utility, and layers on lower
  floors only; layers on one floor never import each other; a floor-1 utility imports
  nothing of dew but other floor-1 utilities. On top of that, ``RULES`` are stricter:

  - ``dew.core`` imports nothing else of dew, not even a utility: every layer can use it;
  - ``dew._attention`` (torch mask plumbing), ``dew._net`` (socket binding),
    ``dew._watchdog`` and ``dew._runlock`` import nothing of dew;
  - engines (``dew.serving``), sources (``dew.objectives.rl.sources``) and the gateway
    (``dew.gateway``) import only the core, a few named utilities and themselves, never
    each other;

* no circle: the module-level import graph (each import resolved to the module of
  ``src/dew`` it names; a package's ``__init__`` is the module ``dew.x``) has no strongly
  connected component of more than one module, and no module imports itself. A
  package's ``__init__`` importing its own submodules is an edge like any other, so a
  submodule doing ``from dew.pkg import name`` (rather than ``from dew.pkg.mod``) of a
  package that re-exports it closes a circle; ``from dew.pkg import _mod`` names the
  module ``dew.pkg._mod``, not the ``__init__``;
* no private crossing: a module whose dotted path has a component beyond ``dew._x``
  that starts with one underscore (``dew.pool._checkpoint``, ``dew.core._checks``,
  ``dew.serving.fleet._fleet``) is imported only from its own layer; so is a private
  name (``from dew._checkpoint import _sha256``). The top-level modules ``dew._x`` are
  the house's shared floor 1 and exempt themselves.

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` too:
a deferred import is still a dependency. The checks are pure functions of
``(module, is_package, source)`` triples, so seeded inputs need no files.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
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
    "dew.serving": ("dew.core", "dew._attention", "dew._watchdog", "dew._runlock", "dew._net"),
    "dew._watchdog": (),
    "dew._runlock": (),
    "dew._attention": (),
    # dew._net: binding a listening socket, for the HTTP servers of both layers.
    "dew._net": (),
    "dew.objectives.rl.sources": ("dew.core",),
    "dew.gateway": ("dew.core", "dew._net"),
}

# package -> its floor. A module may import its own package, any floor-1 utility and the
# packages on lower floors; packages on one floor never import each other. The first
# package containing a module is its layer, so the sources come before dew.objectives.
# dew.recipe (the one place a training job is assembled) is checked once it exists.
# dew.cli sits above dew.serve: it runs dew.serve's main for `dew serve`.
FLOORS: dict[str, int] = {
    "dew.core": 1,
    "dew.serving": 2,
    "dew.objectives.rl.sources": 2,
    "dew.gateway": 2,
    "dew.objectives": 3,
    "dew.pool": 4,
    "dew.train": 5,
    "dew.recipe": 6,
    "dew.job": 7,
    "dew.demo": 7,
    # The planner advises on the runs of job and demo, and its "tail" preset reads the
    # demo's heavy-tailed workload (dew.demo.tail.Workload), so it stands above them.
    "dew.plan": 8,
    "dew.serve": 8,
    "dew.cli": 9,
}
UTILITY_FLOOR = 1
# Floor-1 utilities besides the top-level private modules dew._x (any of them, new ones
# too): each is its own layer and imports nothing of dew but other floor-1 utilities.
UTILITIES = ("dew", "dew.data", "dew.plot")
# Packages of FLOORS still being written: their absence is no failure.
COMING = ("dew.recipe",)


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


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def is_utility(name: str) -> bool:
    parts = name.split(".")
    return name in UTILITIES or (len(parts) >= 2 and parts[0] == "dew" and is_private(parts[1]))


def layer(name: str) -> str | None:
    """The layer a dotted dew name belongs to: a FLOORS package or a floor-1 utility."""
    found = next((p for p in FLOORS if within(name, p)), None)
    if found is not None:
        return found
    parts = name.split(".")
    top = ".".join(parts[:2])
    if name == "dew" or is_utility(top):
        return name if name == "dew" else top
    return None


def floor(layer_name: str) -> int:
    return FLOORS.get(layer_name, UTILITY_FLOOR)


def named(source: str, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The dew modules a file's import statements name, one per imported name.

    ``import a.b`` names ``a.b``; ``from a import b`` names ``a.b`` when that is a known
    module (or a layer: a FLOORS package or a utility), else ``a`` (``b`` is then a name
    defined in ``a``).
    Relative imports are resolved. Names outside dew are left out.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            full = [f"{stem}.{alias.name}" for alias in node.names]
            names = [n if n in known or layer(n) == n else stem for n in full]
        else:
            continue
        yield from (n for n in names if within(n, "dew"))


def edges(files: Iterable[tuple[str, bool, str]]) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports (a name inside a module, such as
    ``dew.core.Call``, counts as its module; names of no module of ``files`` are left
    out). Self-imports are kept: they are circles too."""
    files = list(files)
    known = {module for module, _, _ in files}
    graph: dict[str, set[str]] = {module: set() for module in known}
    for module, is_package, source in files:
        for name in named(source, module, is_package, known):
            while name not in known and "." in name:
                name = name.rpartition(".")[0]
            if name in known:
                graph[module].add(name)
    return graph


def circles(files: Iterable[tuple[str, bool, str]]) -> list[list[str]]:
    """The strongly connected components of the import graph with more than one module,
    and the modules that import themselves; each sorted, the list sorted."""
    graph = edges(files)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    # Tarjan's algorithm, iterative: the graph is deep enough to matter for recursion.
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def floor_violations(files: Iterable[tuple[str, bool, str]]) -> list[str]:
    """One line per import of a layer on the same or a higher floor (or of anything
    but a floor-1 utility by a floor-1 utility), and per module of no layer."""
    files = list(files)
    known = {module for module, _, _ in files}
    out = []
    for module, is_package, source in files:
        home = layer(module)
        if home is None:
            out.append(f"{module} belongs to no layer; add its package to FLOORS")
            continue
        for name in sorted(set(named(source, module, is_package, known))):
            there = layer(name)
            if there is None or there == home or is_utility(there):
                continue  # RULES keep dew.core and a few utilities off the other utilities
            if is_utility(home) or floor(there) >= floor(home):
                out.append(
                    f"{module} ({home}, floor {floor(home)}) imports {name} "
                    f"({there}, floor {floor(there)})"
                )
    return out


def private_part(name: str) -> str | None:
    """``name`` up to its first component beyond ``dew._x`` that starts with one
    underscore (``dew.core._checks.as_int`` -> ``dew.core._checks``), or None."""
    parts = name.split(".")
    cut = next((i for i in range(2, len(parts)) if is_private(parts[i])), None)
    return None if cut is None else ".".join(parts[: cut + 1])


def private_violations(files: Iterable[tuple[str, bool, str]]) -> list[str]:
    """One line per import of another layer's private module (a component beyond the
    top-level ``dew._x`` that starts with one underscore). ``from a import _b`` counts
    whether ``_b`` is a module or a name: either is private to ``a``'s layer, so
    ``from dew._checkpoint import _sha256`` counts too (only the module ``dew._x`` itself
    is exempt)."""
    out = []
    for module, is_package, source in files:
        found = {private_part(n) for n in imports(source, module, is_package) if within(n, "dew")}
        for name in sorted(n for n in found if n is not None):
            if layer(name) != layer(module):
                out.append(f"{module} imports {name}, private to {layer(name)}")
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


def test_every_floor_package_exists() -> None:
    names = {m for m, _, _ in tree()}
    for package in FLOORS:
        if package not in COMING:
            assert package in names, f"{package} is missing; update FLOORS with the layout"


def test_layers_import_only_what_they_may() -> None:
    assert violations(tree()) == []


def test_every_module_imports_only_lower_floors() -> None:
    found = floor_violations(tree())
    print(*found, sep="\n")
    assert found == []


def test_the_import_graph_has_no_circle() -> None:
    found = circles(tree())
    print(*(" -> ".join(c) for c in found), sep="\n")
    assert found == []


def test_no_layer_imports_another_layers_private_module() -> None:
    found = private_violations(tree())
    print(*found, sep="\n")
    assert found == []


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
        ("dew.core.types", "from dew import _checkpoint\n"),
        ("dew._net", "from dew.core import Call\n"),
    ],
)
def test_the_check_catches_a_crossing(module: str, source: str) -> None:
    assert violations([(module, False, source)]) != []


def test_the_check_allows_the_core_and_the_layer_itself() -> None:
    ok = "from dew.core import Call\nfrom . import _kv\nimport dew.serving._requests\n"
    assert violations([("dew.serving.server", False, ok)]) == []


def test_the_layers_of_names() -> None:
    assert layer("dew.objectives.rl.sources.chat") == "dew.objectives.rl.sources"
    assert layer("dew.objectives.rl.grpo") == "dew.objectives"
    assert layer("dew.train") == "dew.train"
    assert layer("dew._checkpoint") == "dew._checkpoint"
    assert layer("dew._anything_new.x") == "dew._anything_new"
    assert layer("dew.plot") == "dew.plot"
    assert layer("dew") == "dew"
    assert layer("dew.unplaced") is None


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("dew.pool._pool", "from dew.job import config\n"),
        ("dew.objectives.rl.grpo", "import dew.pool\n"),
        ("dew.train", "from dew.demo import run\n"),
        ("dew.train", "def f():\n    from dew.recipe import assemble\n"),
        ("dew.serving.server", "from dew.objectives.rl import grpo\n"),
        ("dew.data", "from dew.core import Call\n"),
        ("dew.plot", "from dew.objectives.rl.metrics import session_metrics\n"),
        ("dew._checkpoint", "from .pool import _pool\n"),
        ("dew.serve", "from dew import cli\n"),
    ],
)
def test_the_floor_check_catches_an_upward_import(module: str, source: str) -> None:
    assert floor_violations([(module, False, source)]) != []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("dew.job.run", "from dew.demo.run import main\n"),
        ("dew.demo.run", "import dew.plan\n"),
        ("dew.serve", "from dew.plan import cli\n"),
        ("dew.serving.server", "from dew.gateway import RecordingGateway\n"),
        ("dew.gateway._app", "from dew.objectives.rl.sources import PromptSource\n"),
    ],
)
def test_the_floor_check_catches_a_same_floor_crossing(module: str, source: str) -> None:
    assert floor_violations([(module, False, source)]) != []


def test_the_floor_check_catches_a_module_of_no_layer() -> None:
    assert floor_violations([("dew.unplaced", False, "")]) != []


def test_the_floor_check_allows_lower_floors_utilities_and_the_layer_itself() -> None:
    ok = [
        ("dew.job.run", False, "from dew.pool import Pool\nfrom dew import _checkpoint\n"),
        ("dew.job.cli", False, "from dew.plot import draw\nfrom . import run\n"),
        ("dew.recipe", False, "from dew.train import train\nimport dew.objectives.rl.grpo\n"),
        ("dew.demo.run", False, "def f():\n    from dew.recipe import assemble\n"),
        ("dew.pool._hooks", False, "from dew.objectives.rl.scheduler import RolloutScheduler\n"),
        ("dew.objectives.rl.grpo", False, "from dew.objectives.rl.sources import chat\n"),
        ("dew.cli", False, "from dew.serve import main\nfrom dew.job import cli\n"),
        ("dew.plot", False, "from dew import data, _progress\n"),
        ("dew._checkpoint", False, "import dew._runlock\n"),
        ("dew.serving.server", False, "from dew.core import Call\n"),
    ]
    assert floor_violations(ok) == []


def test_the_circle_check_catches_a_circle() -> None:
    two = [("dew.a", False, "import dew.b\n"), ("dew.b", False, "from dew.a import x\n")]
    assert circles(two) == [["dew.a", "dew.b"]]
    three = [
        ("dew.p", True, "from . import q\n"),
        ("dew.p.q", False, "def f():\n    from dew.r import y\n"),
        ("dew.r", False, "from dew.p import z\n"),
        ("dew.s", False, "import dew.p\n"),
    ]
    assert circles(three) == [["dew.p", "dew.p.q", "dew.r"]]
    assert circles([("dew.a", False, "from . import a\n")]) == [["dew.a"]]


def test_the_circle_check_allows_a_chain() -> None:
    chain = [
        ("dew.a", False, "import dew.b\nimport dew.c\n"),
        ("dew.b", False, "from dew.c import x\n"),
        ("dew.c", True, "from dew.c.d import y\n"),
        ("dew.c.d", False, "import os\nfrom dew.e import z\n"),
    ]
    assert circles(chain) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("dew.job.run", "from dew.pool._checkpoint import save\n"),
        ("dew.job.run", "import dew.serving._kv\n"),
        ("dew.job.run", "from dew.pool import _checkpoint\n"),
        ("dew.serving.server", "from dew.core._checks import as_int\n"),
        ("dew.train", "def f():\n    from dew.pool._checkpoint import save\n"),
        ("dew.objectives.rl.grpo", "from dew.objectives.rl.sources._gather import g\n"),
        ("dew.pool._checkpoint", "from dew._checkpoint import _sha256\n"),
    ],
)
def test_the_private_check_catches_a_private_import(module: str, source: str) -> None:
    assert private_violations([(module, False, source)]) != []


def test_the_private_check_allows_the_layer_itself_and_top_level_utilities() -> None:
    ok = [
        ("dew.pool._hooks", False, "from dew.pool._pool import Pool\nfrom . import _shard\n"),
        ("dew.job.run", False, "from dew import _checkpoint\nimport dew._runlock\n"),
        ("dew.serving.http_engine", False, "from dew.serving.fleet._fleet import Fleet\n"),
        ("dew.objectives.rl.grpo", False, "from dew.objectives.rl._driver import Driver\n"),
        ("dew.job.run", False, "from dew.pool import __version__\n"),
    ]
    assert private_violations(ok) == []


def test_only_the_ray_fleet_module_imports_ray() -> None:
    """Ray is an extra: one module of the fleet imports it, and only when a Ray fleet is
    made; every other module of dew works without it."""
    importers = sorted(
        module
        for module, is_package, source in tree()
        if any(within(name, "ray") for name in imports(source, module, is_package))
    )
    assert importers == ["dew.serving.fleet._ray"], importers

"""The layer rules of DESIGN.md section 3, read off every import of the package's source.

Each module of `moe_engine/`, `kernels/`, `comm/` and `quant/` is parsed with `ast`; every
import counts (module level, inside functions, under `TYPE_CHECKING`). A module may import only
from its own layer or lower ones, and no set of modules may import each other in a cycle. The
layers, bottom up, are `LAYERS` below: this list is the rule, DESIGN.md describes it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_engine", "kernels", "comm", "quant")

#: Layers bottom up: (name, module prefixes). A module belongs to the layer of its longest
#: matching prefix ("moe_engine" alone is the package's own __init__, the offline API facade).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("formats", ("quant",)),
    ("kernels and communicators", ("kernels", "comm")),
    (
        "plain data and counters",
        (
            "moe_engine._omp",
            "moe_engine.errors",
            "moe_engine.request",
            "moe_engine.sampling_params",
            "moe_engine.param_checks",
            "moe_engine.structured_output",
            "moe_engine.instrumentation",
            "moe_engine.phase_timer",
            "moe_engine.routing_capture",
            "moe_engine.skew",
        ),
    ),
    ("kv cache", ("moe_engine.kv_cache",)),
    ("startup", ("moe_engine.startup",)),
    ("scheduler", ("moe_engine.scheduler",)),
    ("models", ("moe_engine.models",)),
    ("runner", ("moe_engine.runner",)),
    ("core", ("moe_engine.core", "moe_engine.weight_update", "moe_engine.eplb")),
    ("engine", ("moe_engine.engine",)),
    (
        "front ends and APIs",
        (
            "moe_engine",
            "moe_engine.offline",
            "moe_engine.disagg",
            "moe_engine.server",
            "moe_engine.rl",
        ),
    ),
    ("cli", ("moe_engine.cli",)),
)


@dataclass(frozen=True)
class Import:
    """One import of one package module by another."""

    source: str
    target: str
    path: str
    line: int


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the four packages under `root`."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(
    name: str, path: Path, modules: dict[str, Path], root: Path = REPO
) -> list[Import]:
    """Every import in `path` of another package module (the longest existing module name
    each imported name resolves to)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
                found.append(Import(name, target, rel, node.lineno))
    return found


def layer_of(module: str) -> int:
    """The index in `LAYERS` of `module`'s layer.

    Raises:
        LookupError: a module no layer claims (add it to `LAYERS`).
    """
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    if index is None:
        raise LookupError(f"{module}: in no layer of tests/test_layers.py LAYERS")
    return index


def all_imports(root: Path = REPO) -> list[Import]:
    """Every import between the package's modules under `root`."""
    modules = module_files(root)
    return [
        imp for name, path in modules.items() for imp in imports_of(name, path, modules, root)
    ]


def cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    unclaimed = []
    for module in module_files():
        try:
            layer_of(module)
        except LookupError as exc:
            unclaimed.append(str(exc))
    assert not unclaimed, "\n".join(unclaimed)


def test_imports_go_down_the_layers() -> None:
    upward = []
    for imp in sorted(set(all_imports()), key=lambda i: (i.path, i.line, i.target)):
        mine, theirs = layer_of(imp.source), layer_of(imp.target)
        if theirs > mine:
            upward.append(
                f"{imp.path}:{imp.line}: {imp.source} (layer '{LAYERS[mine][0]}') imports "
                f"{imp.target} (layer '{LAYERS[theirs][0]}'), a layer above it"
            )
    assert not upward, "imports that go up a layer (DESIGN.md section 3):\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    imports = all_imports()
    report = []
    for component in cycles(imports):
        members = set(component)
        edges = [
            f"    {imp.path}:{imp.line}: {imp.source} -> {imp.target}"
            for imp in imports
            if imp.source in members and imp.target in members
        ]
        report.append(f"cycle through {len(component)} modules:\n" + "\n".join(edges))
    assert not report, "import cycles (DESIGN.md section 3):\n" + "\n".join(report)


def test_no_private_names_across_files() -> None:
    """`from x import _name` between the package's own modules: a private name is its
    module's own."""
    modules = module_files()
    crossing = []
    for path in modules.values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        rel = path.relative_to(REPO).as_posix()
                        crossing.append(f"{rel}:{node.lineno}: {alias.name} from {node.module}")
    assert not crossing, "private names imported across files:\n" + "\n".join(crossing)


@pytest.mark.parametrize(
    ("imports", "expected"),
    [
        ([Import("a", "b", "a.py", 1), Import("b", "a", "b.py", 2)], [["a", "b"]]),
        ([Import("a", "b", "a.py", 1), Import("b", "c", "b.py", 2)], []),
        (
            [Import("a", "b", "a.py", 1), Import("b", "c", "b.py", 1), Import("c", "a", "c", 1)],
            [["a", "b", "c"]],
        ),
    ],
)
def test_the_cycle_finder_finds_cycles(imports: list[Import], expected: list[list[str]]) -> None:
    assert cycles(imports) == expected


def test_the_layer_rule_sees_imports_in_functions_and_type_checking(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from moe_engine.cli import serve\n"
        "def f():\n"
        "    import moe_engine.engine.client\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    modules = {"moe_engine.cli.serve": path, "moe_engine.engine.client": path}
    found = imports_of("moe_engine.kv_cache.probe", path, modules)
    assert [(i.target, i.line) for i in found] == [
        ("moe_engine.cli.serve", 3),
        ("moe_engine.engine.client", 5),
    ]
    assert all(layer_of(i.target) > layer_of("moe_engine.kv_cache.probe") for i in found)


def summary(root: Path) -> str:
    """The import graph of the checkout at `root` in numbers: modules, imports, imports from
    kernels/, comm/ and quant/ into moe_engine/, cycles and their sizes, and the imports that go
    up a layer (only where every module has a layer)."""
    imports = all_imports(root)
    edges = {(i.source, i.target) for i in imports}
    low = {"kernels", "comm", "quant"}
    into = {e for e in edges if e[0].split(".")[0] in low and e[1].startswith("moe_engine")}
    found = cycles(imports)
    lines = [
        f"modules {len(module_files(root))}, imports between them {len(edges)}",
        f"imports of moe_engine/ by kernels/, comm/ or quant/: {len(into)}",
        f"import cycles: {len(found)} (sizes {sorted(len(c) for c in found)})",
    ]
    try:
        upward = {e for e in edges if layer_of(e[1]) > layer_of(e[0])}
        lines.append(f"imports that go up a layer: {len(upward)}")
    except LookupError as exc:
        lines.append(f"layers: not all modules have one ({exc})")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    # python tests/test_layers.py [CHECKOUT]: the import graph's numbers for a checkout
    checkout = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO
    if not (checkout / "moe_engine" / "__init__.py").is_file():
        sys.exit(f"{checkout}: not a moe-engine checkout (no moe_engine/__init__.py)")
    print(summary(checkout))

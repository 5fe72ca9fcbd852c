"""The package's layers: no module imports one of a higher layer, and no modules import each other in a circle.

:data:`LAYERS` is the one declaration of the order, lowest first: a module may import modules of its
own layer and of lower ones. Every import counts, those only for type checkers
(``if TYPE_CHECKING:``) too: they are dependencies all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "shardplug"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("shardplug.core._internal",),  # helpers every folder uses: arguments, collectives, compat, rows, topology
    ("shardplug.core.shuffle",),  # seeds, samplers, the agreement with process 0
    ("shardplug.core.config",),  # ShardplugConfig: the options, validated
    ("shardplug.core.sharding",),  # which rows each process gets: one module per kind of sharding
    ("shardplug.core.padding",),  # which rows are padding: tracking, metrics, the audit
    ("shardplug.core.resume",),  # positions as values: Position, checks, lengths, the StatefulDataLoader's state
    ("shardplug.core.loader",),  # the prepared loader, its cursor, its passes, its resume state
    ("shardplug.core.graphs",),  # torchdata.nodes graphs: read, prepared on the loader, rebuilt on a part
    ("shardplug.core.dispatch",),  # process 0 reads, every process receives its rows
    ("shardplug.core.planner", "shardplug.core.evaluation"),  # the assembler: prepare_data_loader
    ("shardplug.core.stepping",),  # optimizer, scheduler, accumulation, TrainingRun
    ("shardplug.core",),  # the core's public names, and front_ends.py: the helpers the front ends use
    ("shardplug",),  # the package's public names
    ("shardplug.explain", "shardplug.__main__"),  # the explain tool, above everything it draws
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer: the longest prefix that names one."""
    best, best_length = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")
    return best


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """The shardplug modules ``module`` imports, with the line of each import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up level - 1 folders
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "shardplug" and name != module:
                yield name, node.lineno


GRAPH = {module: sorted({name for name, _ in _imports(module, path)}) for module, path in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    here = layer_of(module)
    upward = [
        f"line {line}: {name} ({LAYERS[layer_of(name)][0]} is above {LAYERS[here][0]})"
        for name, line in _imports(module, MODULES[module])
        if layer_of(name) > here
    ]
    assert not upward, f"{module} imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_an_upward_import_and_a_cycle() -> None:
    """The checks themselves: a lower module importing a higher one, and a circle of three, are found."""
    assert layer_of("shardplug.core.sharding.native") < layer_of("shardplug.core.loader.prepared")
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found

"""The front ends (the integration packages) take the core's shared helpers from its public modules only.

``shardplug.core._internal`` is the core's own: a front end that imports it breaks whenever the core reorganises
its helpers. What a front end needs of them is re-exported by :mod:`shardplug.core.front_ends`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p for p in (ROOT / "integrations").glob("*/shardplug_*") if (p / "__init__.py").is_file())
INTERNAL = "shardplug.core._internal"


def internal_imports(source: str) -> Iterator[tuple[int, str]]:
    """The imports of ``source`` that reach :data:`INTERNAL` (as ``import``, ``from ... import`` or the
    package imported by name from ``shardplug.core``), with their lines."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == INTERNAL or name.startswith(INTERNAL + "."):
                yield node.lineno, name
                break


def test_there_are_front_ends_to_check() -> None:
    assert {p.name for p in PACKAGES} >= {"shardplug_lightning", "shardplug_ignite"}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_front_end_imports_the_cores_internal_helpers(package: Path) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(package.rglob("*.py"))
        for line, name in internal_imports(path.read_text())
    ]
    assert not found, f"{package.name} imports {INTERNAL} (take it from shardplug.core.front_ends):\n" + "\n".join(
        found
    )


def test_the_check_sees_each_form_of_import() -> None:
    for source in (
        "from shardplug.core._internal.rows import iter_leaves",
        "from shardplug.core._internal import compat",
        "from shardplug.core import _internal",
        "import shardplug.core._internal.arguments",
    ):
        assert [line for line, _ in internal_imports(source)] == [1], source
    assert not list(internal_imports("from shardplug.core.front_ends import iter_leaves\nimport shardplug.core"))

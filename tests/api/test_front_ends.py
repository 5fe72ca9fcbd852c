"""The front ends (the integration packages) reach the core through its public paths only: its shared helpers
from :mod:`shardplug.core.front_ends`, a loader's epoch through its methods.

``shardplug.core._internal`` is the core's own: a front end that imports it breaks whenever the core reorganises
its helpers. What a front end needs of them is re-exported by :mod:`shardplug.core.front_ends`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

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


def _shuffled_loader() -> Any:
    data = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    return prepare_data_loader(data, num_processes=2, process_index=0, data_seed=0)


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_renumber_epoch_numbers_the_pass_in_progress_without_entering_the_epoch() -> None:
    """What a front end whose loop cut a pass short does (Lightning's strategy, ``limit_train_batches``): the
    position names the front end's epoch, the pass reads on in its order, a complete pass moves on from it."""
    loader, reference = _shuffled_loader(), _shuffled_loader()
    epoch_0 = _batches(reference)
    pass_ = iter(loader)
    first = next(pass_).tolist()
    loader.renumber_epoch(3)
    assert loader.epoch == 3 and loader.state_dict()["epoch"] == 3
    assert loader.state_dict()["batches_yielded"] == 1, "the pass in progress keeps its place"
    assert [first] + _batches(pass_) == epoch_0, "the pass reads on in the order it began with"
    reference.set_epoch(4)
    assert _batches(loader) == _batches(reference), "the complete pass moved the loader on to epoch 4"
    assert loader.epoch == 4
    with pytest.raises(ValueError, match="epoch=-1"):
        loader.renumber_epoch(-1)

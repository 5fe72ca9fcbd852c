"""The documentation site: docs/api.md lists the public names, and the API reference reads the Sphinx docstrings.

The docstrings are written for Sphinx; ``docs/_griffe/shardplug_docstrings.py`` rewrites them for mkdocstrings
while the site is built (docs/internals.md, "The API reference"). These tests load a small package of their own
with griffe and that extension: what a role, a literal block and a default become. ``make docs`` (CI) builds the
real site strictly.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shardplug", "shardplug_lightning", "shardplug_ignite")


def _api_page_names() -> set[str]:
    """The ``::: package.Name`` entries of docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^::: (\S+)$", text, flags=re.MULTILINE))


def test_api_reference_lists_each_public_name_once() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("ignite")
    documented = _api_page_names()
    objects = [getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]) for path in documented]
    missing = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for name in package.__all__:
            path = f"{package_name}.{name}"
            # a re-export of a name documented elsewhere (shardplug_ignite.ShardplugConfig) is that entry
            if path not in documented and not any(obj is getattr(package, name) for obj in objects):
                missing.append(path)
    assert not missing, f"docs/api.md does not document these public names: {missing}"
    exported = {f"{package}.{name}" for package in PACKAGES for name in importlib.import_module(package).__all__}
    assert documented <= exported, f"docs/api.md documents names no __all__ exports: {sorted(documented - exported)}"


def _extension() -> ModuleType:
    pytest.importorskip("griffe")
    path = ROOT / "docs" / "_griffe" / "shardplug_docstrings.py"
    spec = importlib.util.spec_from_file_location("shardplug_docstrings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


TOY = {
    "__init__.py": '''
        """A package."""

        from .core import Config, Loader, prepare

        __all__ = ["Config", "Loader", "prepare"]
    ''',
    "core.py": '''
        """The core.

        Example::

            >>> prepare(2)
            2
        """

        import torch

        from ._helpers import Helper


        class Config:
            """Options.

            Args:
                split: split the batches (:meth:`Loader.reset`).
            """

            split: bool = False
            seed: int = 3


        class Loader:
            """A loader: see :class:`Config`, :meth:`reset`, :attr:`~toypkg.core.Config.split`, :class:`Helper`,
            :class:`torch.optim.Optimizer`, :func:`!prepare` and :class:`NoSuchName`.

            Typical loop::

                for batch in loader:
                    step(batch)
            """

            def reset(self, split: bool = Config.split, seed: int = Config.seed) -> None:
                """Start again (:meth:`Loader.reset`)."""


        def prepare(x: int) -> int:
            """Prepare ``x``."""
            return x
    ''',
    "_helpers.py": '''
        class Helper:
            """Internal."""
    ''',
}


def test_extension_reads_roles_literal_blocks_and_defaults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    extension = _extension()
    import griffe

    package = tmp_path / "toypkg"
    package.mkdir()
    for name, text in TOY.items():
        (package / name).write_text(textwrap.dedent(text).lstrip())
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(extension.ShardplugDocstrings(packages=["toypkg"])),
        search_paths=[str(tmp_path)],
    )
    with caplog.at_level(logging.WARNING):
        loader.load("toypkg")
    loader.resolve_aliases()
    loader_doc = loader.modules_collection["toypkg.core.Loader"].docstring.value
    # documented objects (in __all__, or a public member of one): links autorefs must find
    assert "[`Config`][toypkg.core.Config]" in loader_doc
    assert "[`reset()`][toypkg.core.Loader.reset]" in loader_doc
    # a field without a docstring is described by its class: the link goes there
    assert "[`split`][toypkg.core.Config]" in loader_doc
    # internal, or another project's: code, a link only if autorefs finds the target
    assert '<autoref identifier="toypkg._helpers.Helper" optional>`Helper`</autoref>' in loader_doc
    assert '<autoref identifier="torch.optim.Optimizer" optional>`torch.optim.Optimizer`</autoref>' in loader_doc
    assert "`prepare()` and" in loader_doc
    # a name that names nothing: a warning (the strict build fails), and a reference autorefs cannot find
    assert "[`NoSuchName`][NoSuchName]" in loader_doc
    assert any(":class:`NoSuchName`" in record.getMessage() for record in caplog.records)
    assert sum("names nothing" in record.getMessage() for record in caplog.records) == 1
    assert ":class:" not in loader_doc and ":meth:" not in loader_doc
    # a reference to the object itself is code, not a link to its own entry
    reset_doc = loader.modules_collection["toypkg.core.Loader.reset"].docstring.value
    assert reset_doc == (
        'Start again (<autoref identifier="toypkg.core.Loader.reset" optional>`Loader.reset()`</autoref>).'
    )
    # literal blocks: fenced code, the marker's text kept without "::"
    assert "Typical loop:\n\n```python\nfor batch in loader:\n    step(batch)\n```" in loader_doc
    module_doc = loader.modules_collection["toypkg.core"].docstring.value
    assert module_doc == "The core.\n\nExample:\n\n```pycon\n>>> prepare(2)\n2\n```"
    # defaults that name a constant show its value
    parameters = loader.modules_collection["toypkg.core.Loader.reset"].parameters
    assert (str(parameters["split"].default), str(parameters["seed"].default)) == ("False", "3")

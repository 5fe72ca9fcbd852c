"""The examples in the package's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import shardplug

MODULES = sorted(m.name for m in pkgutil.walk_packages(shardplug.__path__, prefix="shardplug."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, (
        f"{result.failed} docstring example(s) of {name} failed "
        f"(run: python -m pytest --doctest-modules {name.replace('.', '/')}.py)"
    )

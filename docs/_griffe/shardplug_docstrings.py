"""Griffe extension: the API reference reads the packages' Sphinx-style docstrings as Markdown.

The docstrings of shardplug, shardplug_lightning and shardplug_ignite are written for Sphinx
(``:class:`Name```, ``Example::`` literal blocks, defaults that name a ``ShardplugConfig`` field);
mkdocstrings renders Google-style Markdown. This extension rewrites each docstring when griffe has
loaded the packages, before mkdocstrings parses it, so that the source stays as it is:

* a role (``:class:``, ``:meth:``, ``:attr:``, ``:func:``, ``:mod:``, ``:data:``, ``:exc:``,
  ``:obj:``, ``:const:``; ``~`` for the short title, ``title <target>``, ``!`` for no link) becomes
  a cross-reference to the object it names, resolved like Sphinx resolves it: a full path, else the
  enclosing class (inherited members too), its module and their imports, else a public name of one
  of the three packages, else the only object of the three packages with that name;

  - an object the API reference documents (a name in a package's ``__all__``, or a public member
    of one) becomes a link, and a reference autorefs cannot find fails ``mkdocs build --strict``;
  - an object of the packages the reference does not document (internal modules and helpers) and
    an object outside them (torch, Lightning, Ignite: no inventory is configured) is shown as code,
    its full path as a tooltip (a link as soon as the object is documented or an inventory added);
  - a name that names nothing is a warning, which fails the strict build;

* ``text::`` followed by an indented literal block becomes ``text:`` and a fenced code block
  (``pycon`` for doctests, ``python`` for code that parses, ``text`` otherwise);
* a parameter default that names a constant of the packages (``ShardplugConfig.split_batches``)
  shows that constant's value (``False``).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import griffe

PACKAGES = ("shardplug", "shardplug_lightning", "shardplug_ignite")

_ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|attr|func|mod|data|exc|obj|const):`(?P<body>[^`]+)`")
_EXPLICIT_TITLE = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")
_CALLABLE_ROLES = ("meth", "func")
_LITERAL_VALUE = re.compile(r"^(True|False|None|-?\d+(\.\d+)?|'[^']*'|\"[^\"]*\"|\(\)|\[\]|\{\})$")


def _members(obj: griffe.Object | griffe.Alias) -> dict[str, Any]:
    """The members a name can be looked up in: a class's inherited ones too."""
    try:
        return dict(obj.all_members) if obj.is_class else dict(obj.members)
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return {}


def _exports(module: griffe.Module) -> list[str]:
    """The names in a module's ``__all__``."""
    return [export if isinstance(export, str) else export.name for export in module.exports or ()]


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """The object and every object defined in it (aliases, that is imports, left out)."""
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):
            yield from _walk(member)


@dataclass(frozen=True)
class _Target:
    """What a role's target names: its path; the object when it is one of the packages' (else ``None``),
    and whether docs/api.md shows it."""

    path: str
    obj: griffe.Object | None = None
    documented: bool = False


class ShardplugDocstrings(griffe.Extension):
    """Rewrites the three packages' docstrings and defaults once griffe has loaded all of them."""

    def __init__(self, packages: list[str] | tuple[str, ...] = PACKAGES) -> None:
        super().__init__()
        self.packages = tuple(packages)
        self._done: set[str] = set()
        self._busy = False
        self._collection: griffe.ModulesCollection | None = None
        self._documented: set[str] = set()

    # -- the hook -------------------------------------------------------------------------------

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in self.packages or self._busy:
            return
        self._busy = True
        try:
            # Names in one package's docstrings refer to the others': load them all first.
            for name in self.packages:
                if name not in loader.modules_collection:
                    try:
                        loader.load(name, try_relative_path=False)
                    except ImportError:
                        griffe.logger.debug(f"shardplug_docstrings: {name} not found, its names are left out")
            self._collection = loader.modules_collection
            self._documented = self._documented_roots()
            for name in self.packages:
                if name in loader.modules_collection and name not in self._done:
                    self._done.add(name)
                    for obj in _walk(loader.modules_collection[name]):
                        self._rewrite(obj)
        finally:
            self._busy = False

    def _rewrite(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            value = rewrite_literal_blocks(obj.docstring.value)
            obj.docstring.value = _ROLE.sub(lambda match: self._role(obj, match), value)
        if isinstance(obj, griffe.Function):
            for parameter in obj.parameters:
                if isinstance(parameter.default, (griffe.ExprName, griffe.ExprAttribute)):
                    parameter.default = self._constant(obj, str(parameter.default)) or parameter.default

    # -- roles ----------------------------------------------------------------------------------

    def _role(self, obj: griffe.Object, match: re.Match[str]) -> str:
        role, body = match["role"], match["body"].strip()
        explicit = _EXPLICIT_TITLE.match(body)
        title, target = (explicit["title"], explicit["target"]) if explicit else (None, body)
        no_link = target.startswith("!")
        short = target.startswith("~")
        target = target.lstrip("!~.")
        if title is None:
            title = target.rsplit(".", 1)[-1] if short else target
            if role in _CALLABLE_ROLES:
                title += "()"
        code = f"`{title}`"
        if no_link:
            return code
        found = self._resolve(obj, target)
        if found is None:
            griffe.logger.warning(
                f"{obj.relative_filepath}:{obj.docstring.lineno if obj.docstring else obj.lineno}: {match[0]} in "
                f"the docstring of {obj.path} names nothing in {', '.join(self.packages)} (write its full path, "
                f"or ``{target}`` for code)"
            )
            return f"[{code}][{target}]"
        if found.documented:
            # mkdocstrings leaves out a member without a docstring (a dataclass field described in its
            # class's Args): the link goes to the nearest object that is shown.
            shown = found.obj
            while shown is not None and shown.docstring is None and shown.parent is not None:
                if not self._is_documented(shown.parent.path):
                    break
                shown = shown.parent
            if shown is not None and shown.path != obj.path:  # (not a link to the page's own entry)
                return f"[{code}][{shown.path}]"
        # Not documented here (internal, or another project's): code, linked if autorefs finds it.
        return f'<autoref identifier="{found.path}" optional>{code}</autoref>'

    def _resolve(self, obj: griffe.Object, target: str) -> _Target | None:
        head, *tail = target.split(".")
        candidates: list[Any] = []
        if head in self._loaded():
            candidates.append(self._loaded()[head])
        scope: Any = obj if obj.is_class or obj.is_module else obj.parent
        while scope is not None and not candidates:
            if head in _members(scope):
                candidates.append(_members(scope)[head])
            elif scope.is_class and scope.name == head:
                candidates.append(scope)
            scope = scope.parent
        if not candidates:
            for name in self.packages:
                package = self._loaded().get(name)
                if package is not None and head in _exports(package):
                    candidates.append(package.members[head])
                    break
        if not candidates:
            named = self._objects_named(head)
            if len(named) == 1:
                candidates.extend(named)
        if not candidates:
            if head not in self.packages and importlib.util.find_spec(head) is not None:
                return _Target(target)  # another project's full path: torch.optim.Optimizer
            return None
        return self._follow(candidates[0], tail)

    def _follow(self, found: Any, tail: list[str]) -> _Target | None:
        """The target ``found.tail``, through aliases (imports) to the object they name."""
        for name in tail:
            try:
                target = found.final_target if found.is_alias else found
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return self._outside(f"{found.target_path}.{'.'.join(tail)}")
            members = _members(target)
            if name not in members:
                return None
            found = members[name]
        try:
            target = found.final_target if found.is_alias else found
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return self._outside(found.target_path)
        return _Target(target.path, target, self._is_documented(target.path))

    def _outside(self, path: str) -> _Target | None:
        """A path griffe cannot follow: another project's object, or nothing when it is in ours."""
        if path.split(".", 1)[0] in self.packages:
            return None
        return _Target(path)

    # -- what the reference documents ----------------------------------------------------------

    def _loaded(self) -> dict[str, griffe.Module]:
        assert self._collection is not None
        return {name: self._collection[name] for name in self.packages if name in self._collection}

    def _documented_roots(self) -> set[str]:
        """The canonical paths of the names in the packages' ``__all__`` (docs/api.md documents them)."""
        roots = set()
        for package in self._loaded().values():
            for name in _exports(package):
                try:
                    roots.add(package[name].canonical_path)
                except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                    continue
        return roots

    def _is_documented(self, path: str) -> bool:
        """Whether docs/api.md shows ``path``: a name of an ``__all__``, or a public member of one."""
        if path in self._documented:
            return True
        for root in self._documented:
            if path.startswith(root + "."):
                return not any(part.startswith("_") for part in path[len(root) + 1 :].split("."))
        return False

    def _objects_named(self, name: str) -> list[griffe.Object]:
        found: dict[str, griffe.Object] = {}
        for package in self._loaded().values():
            for obj in _walk(package):
                if obj.name == name:
                    found[obj.path] = obj
        return list(found.values())

    # -- defaults -------------------------------------------------------------------------------

    def _constant(self, obj: griffe.Object, expression: str) -> str | None:
        """The literal value of a default like ``ShardplugConfig.split_batches``, if it names one."""
        found = self._resolve(obj, expression)
        if found is None or found.obj is None:
            return None
        value = getattr(found.obj, "value", None)
        if value is None or not _LITERAL_VALUE.match(str(value)):
            return None
        return str(value)


# -- literal blocks --------------------------------------------------------------------------------


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _language(code: str) -> str:
    if code.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(code)
    except SyntaxError:
        return "text"
    return "python"


def rewrite_literal_blocks(text: str) -> str:
    """reST literal blocks (a paragraph ending ``::``, then an indented block) as fenced code.

    >>> print(rewrite_literal_blocks("A loop::\\n\\n    for x in xs:\\n        f(x)\\n\\nAfter."))
    A loop:
    <BLANKLINE>
    ```python
    for x in xs:
        f(x)
    ```
    <BLANKLINE>
    After.
    """
    lines = text.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.rstrip().endswith("::"):
            out.append(line)
            continue
        start = index
        while start < len(lines) and not lines[start].strip():
            start += 1
        margin = _indent(line)
        end = start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > margin):
            end += 1
        if start == end or start == index:  # no indented block after a blank line: not a literal block
            out.append(line)
            continue
        while not lines[end - 1].strip():
            end -= 1
        stripped = line.rstrip()[:-2].rstrip()
        if stripped.strip():
            out.append(stripped + (":" if line.rstrip()[:-2] == stripped else ""))
            out.append("")
        code = textwrap.dedent("\n".join(lines[start:end]))
        fence = " " * margin + "```"
        out.append(fence + _language(code))
        out.extend(" " * margin + code_line if code_line else "" for code_line in code.split("\n"))
        out.append(fence)
        index = end
    return "\n".join(out)

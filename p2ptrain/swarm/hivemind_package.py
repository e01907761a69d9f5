"""hivemind without its package `__init__`s: p2ptrain uses its DHT node and p2p parts only.

`import hivemind` runs hivemind/__init__.py, which imports its averager, mixture-of-experts and
optimizer stacks (scipy among them), and `hivemind.utils` and `hivemind.dht` import torch (for the
shared memory of hivemind's multiprocess futures and its tensor descriptors): about 3 s of CPU in
every node, bootstrap peer and `status` call, for code p2ptrain never runs. `install` puts bare
packages in their place, so their submodules load on their own; a name asked of a package itself
(`hivemind.utils.get_logger`, `hivemind.DHT`) loads only the submodule its `__init__` takes that
name from, and any other name runs the real `__init__` into the package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

PACKAGES = ("hivemind", "hivemind.dht", "hivemind.utils")
"""Parents first: finding a subpackage imports its parent."""


def install() -> None:
    """Register the bare packages, unless hivemind is imported already (then nothing changes)."""
    if PACKAGES[0] in sys.modules:
        return
    for name in PACKAGES:
        _install_bare(name)


def _install_bare(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed: the import that needs it says so
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = name
    if name == PACKAGES[0]:
        package.__version__ = importlib.metadata.version(name)  # type: ignore[attr-defined]
    sources = _names_imported_from_submodules(Path(spec.origin or ""), name)

    def load(attribute: str) -> Any:
        """PEP 562: a name the bare package lacks. A submodule (`import hivemind.p2p.x as y` asks
        for `p2p` while it loads) is imported; a name the real __init__ imports from a submodule
        comes from that submodule; any other name from the real __init__, run once."""
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        if importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")
        if attribute in sources:
            return getattr(importlib.import_module(sources[attribute]), attribute)
        del vars(package)["__getattr__"]  # once: the real __init__ fills the package in
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(package)
        return getattr(package, attribute)

    vars(package)["__getattr__"] = load
    sys.modules[name] = package
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, package)


def _names_imported_from_submodules(init_file: Path, package: str) -> dict[str, str]:
    """`from package.sub import a, b as c` in the package's __init__: {"a": "package.sub", "c": ...}."""
    try:
        tree = ast.parse(init_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    sources = {}
    for statement in tree.body:
        if (
            isinstance(statement, ast.ImportFrom)
            and statement.level == 0
            and (statement.module or "").startswith(f"{package}.")
        ):
            for alias in statement.names:
                if alias.name != "*":
                    sources[alias.asname or alias.name] = str(statement.module)
    return sources

"""hivemind without its package `__init__`: p2ptrain uses its DHT and p2p parts only.

`import hivemind` runs hivemind/__init__.py, which imports its averager, mixture-of-experts and
optimizer stacks (scipy among them): about 1.3 s of CPU in every node, bootstrap peer and `status`
call, for code p2ptrain never runs. `install` puts a bare package in its place, so `hivemind.dht`
and `hivemind.p2p` load on their own; a name asked of the package itself (`hivemind.DHT`) still
works: the first such access runs the real `__init__` into it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from typing import Any

PACKAGE = "hivemind"


def install() -> None:
    """Register the bare package, unless hivemind is imported already (then nothing changes)."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed: the import that needs it says so
    package = types.ModuleType(PACKAGE)
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = PACKAGE
    package.__version__ = importlib.metadata.version(PACKAGE)  # type: ignore[attr-defined]

    def load_everything(name: str) -> Any:
        """PEP 562: a name the bare package lacks. A submodule (`import hivemind.p2p.x as y` asks
        for `p2p` while it loads) is imported; any other name comes from the real __init__."""
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
            return importlib.import_module(f"{PACKAGE}.{name}")
        del vars(package)["__getattr__"]  # once: the real __init__ fills the package in
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(package)
        return getattr(package, name)

    vars(package)["__getattr__"] = load_everything
    sys.modules[PACKAGE] = package

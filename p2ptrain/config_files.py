"""Reading configuration sources: TOML files, P2PTRAIN_* variables and `--set` flags, as layers of
(dotted key, value, source) that config.load_config applies in order and validates."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic_core import ErrorDetails

from p2ptrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "P2PTRAIN_"
MOVED = {
    "outer.eager": "outer.overlap.eager",
    "outer.start_correction": "outer.overlap.start_correction",
    "outer.overlap_steps": "outer.overlap.steps",
    "outer.take_on_arrival": "outer.overlap.take_on_arrival",
}
"""Keys that moved, and where to: an old config or command line gets told the new name."""


def parse_scalar(text: str) -> Any:
    """Read `text` as a TOML value; fall back to the raw string (so `--set run.id=abc` works)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


SWITCHES = frozenset({"outer.overlap"})
"""Sections a bare true/false stands for: `outer.overlap = true` is `outer.overlap.enabled = true`,
in a file and in any layer over it, so the two spellings combine."""


def set_dotted(tree: dict[str, Any], dotted: str, *, value: Any, source: str) -> None:
    if dotted in SWITCHES and isinstance(value, bool):
        dotted = f"{dotted}.enabled"
    parts = dotted.split(".")
    if any(not part for part in parts) or len(parts) < 2:
        raise ConfigError(f"{source}: '{dotted}' is not a section.key name")
    node = tree
    for depth, part in enumerate(parts[:-1], start=1):
        child = node.setdefault(part, {})
        if isinstance(child, bool) and ".".join(parts[:depth]) in SWITCHES:
            child = node[part] = {"enabled": child}
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: '{dotted}' goes below a value that is not a section")
        node = child
    node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every P2PTRAIN_SECTION__KEY variable."""
    found = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue  # P2PTRAIN_HOME and similar single names are not config keys
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        found.append((dotted, parse_scalar(environ[name]), f"environment variable {name}"))
    return found


def flag_overrides(assignments: list[str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every `--set section.key=value` flag."""
    found = []
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected section.key=value")
        dotted, _, raw = item.partition("=")
        found.append((dotted.strip(), parse_scalar(raw.strip()), f"--set {item}"))
    return found


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: config file is not readable") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def describe(error: ErrorDetails) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        moved = f" (it is {MOVED[key]} now)" if key in MOVED else ""
        return f"unknown key '{key}'{moved}"
    if isinstance(error.get("input"), dict):  # a check across a section's keys: the message says
        return f"'{key}': {error['msg']}"
    return f"'{key}': {error['msg']} (got {error.get('input')!r})"

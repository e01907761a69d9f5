"""docs/configuration.md, generated from the config models: every field's key, type, default,
bounds, scope (shared by the run or the node's own) and docstring.

    python -m p2ptrain.config_reference            write docs/configuration.md
    python -m p2ptrain.config_reference --check    exit 1 if it is not up to date (make test runs it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MultipleOf
from pydantic.fields import FieldInfo

from p2ptrain.config import Config, Section, is_shared

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from p2ptrain/config.py by `python -m p2ptrain.config_reference`; do not edit by hand
(`make test` checks it is up to date). How settings combine (defaults < TOML file < `P2PTRAIN_*`
variables < `--set`) and how values are read: [05-config-guide.md](05-config-guide.md).

**Scope**: *run* — every node of a run must hold the same value (it is part of the config digest
each heartbeat carries; a node whose digest differs is told which keys differ and is refused);
*node* — each node's own.
"""


def _type_name(field: FieldInfo) -> str:
    annotation = field.annotation
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def _bounds(field: FieldInfo) -> str:
    words = []
    for item in field.metadata:
        if isinstance(item, Ge):
            words.append(f"≥ {item.ge}")
        elif isinstance(item, Gt):
            words.append(f"> {item.gt}")
        elif isinstance(item, Le):
            words.append(f"≤ {item.le}")
        elif isinstance(item, Lt):
            words.append(f"< {item.lt}")
        elif isinstance(item, MultipleOf):
            words.append(f"multiple of {item.multiple_of}")
        elif hasattr(item, "pattern") and item.pattern:
            words.append(f"matches `{item.pattern}`")
    return ", ".join(words)


def _default(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(prefix: str, model: type[Section], lines: list[str]) -> None:
    doc = model.__doc__ if model.__doc__ != Section.__doc__ else None
    lines += ["", f"## `[{prefix}]`", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | scope | what |", "|---|---|---|---|---|"]
    nested: list[tuple[str, type[Section]]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            nested.append((f"{prefix}.{name}", annotation))
            what = _cell(field.description or "") + f" See [`[{prefix}.{name}]`](#{prefix}{name})."
            lines.append(f"| `{name}` | section | | | {what} |")
            continue
        bounds = _bounds(field)
        what = _cell(field.description or "")
        if bounds:
            what += f" ({bounds})"
        scope = "run" if is_shared(field.metadata) else "node"
        kind, default = _cell(_type_name(field)), _default(field.default)
        lines.append(f"| `{name}` | {kind} | {default} | {scope} | {what} |")
    for name, sub in nested:
        _section(name, sub, lines)


def render() -> str:
    lines = [HEADER.rstrip()]
    for name, field in Config.model_fields.items():
        annotation = field.annotation
        assert isinstance(annotation, type) and issubclass(annotation, Section)
        _section(name, annotation, lines)
    return "\n".join(lines) + "\n"


def undocumented() -> list[str]:
    """Dotted keys of fields without a docstring (the reference would show an empty cell)."""
    found = []

    def walk(prefix: str, model: type[Section]) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                walk(f"{prefix}.{name}", annotation)
            elif not field.description:
                found.append(f"{prefix}.{name}")

    for name, field in Config.model_fields.items():
        assert isinstance(field.annotation, type) and issubclass(field.annotation, Section)
        walk(name, field.annotation)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.config_reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    parser.add_argument("--out", type=Path, default=REFERENCE, help="where to write (default %(default)s)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m p2ptrain.config_reference", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

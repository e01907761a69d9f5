"""Decoding bytes that came from the network: every size bounded before it is allocated."""

from __future__ import annotations

from typing import Any

import msgpack


class UndecodableError(ValueError):
    """The bytes are not msgpack within the given limits."""


def unpack_untrusted(data: bytes, max_bytes: int, max_items: int = 64) -> Any:
    """msgpack.unpackb with bounded strings, binaries, arrays and maps, and str map keys only.

    msgpack raises a handful of exception types on garbage; they all become UndecodableError.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_items,
            max_map_len=max_items,
        )
    except Exception as exc:
        raise UndecodableError(f"not msgpack ({type(exc).__name__})") from None


def decimal(text: str, max_digits: int = 12) -> int | None:
    """A non-negative integer written in ASCII digits (at most `max_digits`), else None.

    `str.isdigit` also accepts '²' or '٣', which `int` then refuses or reads as another number."""
    if not text or len(text) > max_digits or not (text.isascii() and text.isdigit()):
        return None
    return int(text)

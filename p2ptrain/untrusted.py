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

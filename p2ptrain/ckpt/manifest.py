"""The manifest of a checkpoint: its files, their sizes and sha256, and the digest of the shared state.

`digest` covers the outer step and the files every member of a step holds byte for byte (θ_outer
and the outer momentum). It is what a node announces in its heartbeat, and what a joiner requires
a majority of the live members to agree on before it trusts any peer's files. Manifests arrive
over the network, so parsing one is strict: bounded size, plain file names only, sane sizes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.ckpt.format import MANIFEST_FILE, SHARED_FILES

MAX_MANIFEST_BYTES = 64 << 10
MAX_FILE_BYTES = 1 << 44
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that is malformed, or does not match the files or the digest it should."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    outer_step: int
    files: dict[str, FileEntry]

    @property
    def digest(self) -> str:
        shared = {name: self.files[name].sha256 for name in SHARED_FILES if name in self.files}
        text = json.dumps({"outer_step": self.outer_step, "shared": shared}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> str:
        files = {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())}
        return json.dumps({"outer_step": self.outer_step, "files": files, "digest": self.digest})


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(folder: Path, outer_step: int) -> Manifest:
    """Hash every file of a checkpoint folder and write manifest.json beside them."""
    files = {
        path.name: FileEntry(path.stat().st_size, file_sha256(path))
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != MANIFEST_FILE
    }
    manifest = Manifest(outer_step, files)
    (folder / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def parse_manifest(data: bytes) -> Manifest:
    """A manifest from untrusted bytes; ManifestError says what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes")
    try:
        raw = json.loads(data)
        step = raw["outer_step"]
        entries = raw["files"]
    except (ValueError, KeyError, TypeError):
        raise ManifestError("manifest is not JSON with outer_step and files") from None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(entries, dict):
        raise ManifestError("manifest outer_step or files malformed")
    files = {}
    for name, entry in entries.items():
        if not isinstance(name, str) or not _NAME.match(name) or name == MANIFEST_FILE:
            raise ManifestError(f"manifest names a file that is not a plain name: {str(name)[:80]!r}")
        if not isinstance(entry, dict):
            raise ManifestError(f"manifest entry {name} malformed")
        size, sha = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
            raise ManifestError(f"manifest entry {name}: bad size")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise ManifestError(f"manifest entry {name}: bad sha256")
        files[name] = FileEntry(size, sha)
    manifest = Manifest(step, files)
    if raw.get("digest") != manifest.digest:
        raise ManifestError("manifest digest does not match its entries")
    return manifest

"""Streaming training data: files → tokens → packed (input, target) sequences, with an exact position.

Every file of the corpus falls in one of `num_shards` shards by the hash of its name. A node reads
the files of its own shard first (chosen by its node key, so it is stable across restarts and
differs between nodes), then the next shards in turn, forever. Tokens of all files are concatenated
with an end-of-text token between documents and cut into sequences of seq_len + 1 tokens.

The position in that stream — how many files were finished and how far into the current one — is a
pair of integers, saved with every checkpoint, and the same for any number of local ranks: every
rank walks the whole node stream and keeps its own slice of each batch.

With `data.interleave = K` the node reads K such streams at once (file j of its order in stream
j mod K) and takes each sequence of a batch from the next of them in turn: a batch, and an inner
phase, then mix K documents where one long file would otherwise fill several phases. The position
is then K pairs and whose turn it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from p2ptrain.config import DataConfig
from p2ptrain.errors import UserError

if TYPE_CHECKING:
    import torch

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".c", ".h", ".js", ".ts", ".html", ".tex", ".json"}
RECORD_SUFFIXES = {".jsonl", ".parquet"}


class DataError(UserError):
    """The configured corpus or tokenizer cannot be used."""


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer: bytes or text in, token ids out."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...


class ByteTokenizer:
    """One token per UTF-8 byte: no vocabulary to ship, and every text round-trips exactly."""

    vocab_size = 256

    def __init__(self, eos_id: int | None = None):
        self.eos_id = 0 if eos_id is None else eos_id

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode() if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package (pip install 'p2ptrain[hf]')."""

    EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")

    def __init__(self, path: Path, eos_id: int | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(f"data.tokenizer {path}: install the 'tokenizers' package to use it") from None
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as exc:
            raise DataError(f"data.tokenizer {path}: not a usable tokenizer.json ({exc})") from None
        self.vocab_size = self._tokenizer.get_vocab_size()
        if eos_id is None:
            ids = [self._tokenizer.token_to_id(name) for name in self.EOS_NAMES]
            eos_id = next((i for i in ids if i is not None), None)
            if eos_id is None:
                raise DataError(f"data.tokenizer {path}: no end-of-text token found; set data.eos_id")
        self.eos_id = eos_id

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def load_tokenizer(config: DataConfig, vocab_size: int) -> Tokenizer:
    """The configured tokenizer, checked against the model's vocabulary."""
    if config.tokenizer == "bytes":
        tokenizer: Tokenizer = ByteTokenizer(config.eos_id)
    else:
        path = Path(config.tokenizer).expanduser()
        if not path.is_file():
            raise DataError(f'data.tokenizer: {path} is not a file (use "bytes" or a tokenizer.json)')
        tokenizer = HFTokenizer(path, config.eos_id)
    if tokenizer.vocab_size > vocab_size or tokenizer.eos_id >= vocab_size:
        raise DataError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}"
        )
    return tokenizer


def embedded_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


INSTALLED_PACKAGES = {"site-packages", "dist-packages"}


def _walk_files(root: Path, skip: set[str]) -> Iterator[Path]:
    """Every non-directory entry below `root`, as `root.rglob("*")` finds them (symbolic links to
    folders are not followed), without descending into folders named in `skip`: the embedded
    corpus's walk would otherwise read every package installed beside the standard library (tens of
    thousands of entries, seconds of every node's and rank's start) only to drop them."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in skip]
        base = Path(folder)
        for name in files:
            yield base / name


def list_files(config: DataConfig) -> list[tuple[str, Path]]:
    """(key, path) of every corpus file, sorted by key; the key names the file in shard hashing."""
    roots = [Path(p).expanduser() for p in config.paths] if config.paths else [embedded_corpus_root()]
    found: dict[str, Path] = {}
    for root in roots:
        if root.is_file():
            found[root.name] = root
            continue
        if not root.is_dir():
            raise DataError(f"data.paths: {root} does not exist")
        suffixes = {".py"} if not config.paths else TEXT_SUFFIXES | RECORD_SUFFIXES
        for path in _walk_files(root, skip=set() if config.paths else INSTALLED_PACKAGES):
            if path.suffix not in suffixes or not path.is_file():
                continue
            if not config.paths and INSTALLED_PACKAGES & set(path.parts):
                continue  # the embedded corpus is the standard library, not what pip installed
            found[f"{root.name}/{path.relative_to(root).as_posix()}"] = path
    if not found:
        raise DataError(f"data.paths: no readable text files under {', '.join(map(str, roots))}")
    return sorted(found.items())


def shard_of(key: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % num_shards


def shard_for_node(node_key: bytes, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(b"p2ptrain-shard" + node_key).digest()[:8], "big") % num_shards


def node_file_order(files: list[tuple[str, Path]], num_shards: int, first_shard: int) -> list[Path]:
    """The node's reading order: its own shard's files, then the next shard's, wrapping around."""
    ordered = sorted(
        files, key=lambda item: ((shard_of(item[0], num_shards) - first_shard) % num_shards, item[0])
    )
    return [path for _, path in ordered]


def read_texts(path: Path, text_field: str) -> Iterator[str | bytes]:
    """The documents of one file: the whole file, or one per JSONL line / Parquet row."""
    if path.suffix == ".jsonl":
        with path.open("rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get(text_field)
                except (ValueError, AttributeError):
                    continue  # a malformed line is skipped, not fatal: corpora are messy
                if isinstance(text, str):
                    yield text
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: install 'pyarrow' to read Parquet files") from None
        for text in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist():
            if isinstance(text, str):
                yield text
    else:
        yield path.read_bytes()


@dataclass
class StreamPosition:
    """Files finished since the start (across passes) and tokens taken from the current one."""

    files_done: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"files_done": self.files_done, "offset": self.offset}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> StreamPosition:
        return cls(int(data["files_done"]), int(data["offset"]))


@dataclass
class DataPosition:
    """Where each of the node's streams is (data.interleave of them), and which gives the next
    sequence."""

    streams: list[StreamPosition]
    turn: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"streams": [position.to_dict() for position in self.streams], "turn": self.turn}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataPosition:
        if "streams" not in data:  # saved before data.interleave: one stream
            return cls([StreamPosition.from_dict(data)])
        return cls([StreamPosition.from_dict(item) for item in data["streams"]], int(data["turn"]))


class TokenStream:
    """Endless token stream over the node's file order; `take(n)` returns the next n tokens."""

    def __init__(self, files: list[Path], tokenizer: Tokenizer, text_field: str = "text"):
        if not files:
            raise DataError("the corpus has no files")
        self.files = files
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.position = StreamPosition()
        self._tokens: np.ndarray | None = None

    def _current(self) -> np.ndarray:
        if self._tokens is None:
            path = self.files[self.position.files_done % len(self.files)]
            eos = np.array([self.tokenizer.eos_id], dtype=np.int64)
            parts = []
            for text in read_texts(path, self.text_field):
                parts += [self.tokenizer.encode(text), eos]
            self._tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._tokens

    def seek(self, position: StreamPosition) -> None:
        self.position = StreamPosition(position.files_done, position.offset)
        self._tokens = None

    def take(self, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        filled = 0
        empty_files = 0
        while filled < count:
            tokens = self._current()
            piece = tokens[self.position.offset : self.position.offset + count - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            self.position.offset += len(piece)
            if self.position.offset >= len(tokens):
                empty_files = empty_files + 1 if len(tokens) == 0 else 0
                if empty_files > len(self.files):
                    raise DataError("every file of the corpus is empty")
                self.position = StreamPosition(self.position.files_done + 1, 0)
                self._tokens = None
        return out


class Batches:
    """Packed batches of one rank: the node takes batch_size sequences per step, from its streams in
    turn (one sequence each), and rank r keeps slice r."""

    def __init__(
        self, streams: list[TokenStream], *, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ):
        if batch_size % world_size:
            raise DataError(
                f"train.batch_size ({batch_size}) must be a multiple of the local ranks ({world_size})"
            )
        self.streams = streams
        self.turn = 0
        """The stream the next sequence comes from."""
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size

    @property
    def position(self) -> DataPosition:
        copies = [StreamPosition(s.position.files_done, s.position.offset) for s in self.streams]
        return DataPosition(copies, self.turn)

    def seek(self, position: DataPosition) -> bool:
        """Continue from `position`; False (nothing moved) where it has another number of streams
        (data.interleave changed since it was saved)."""
        if len(position.streams) != len(self.streams):
            return False
        for stream, where in zip(self.streams, position.streams, strict=True):
            stream.seek(where)
        self.turn = position.turn % len(self.streams)
        return True

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # here: the agent imports this module to check the corpus, and never loads torch

        pieces = []
        for _ in range(self.batch_size):  # with one stream: the next batch_size sequences of it
            pieces.append(self.streams[self.turn].take(self.seq_len + 1))
            self.turn = (self.turn + 1) % len(self.streams)
        tokens = np.concatenate(pieces)
        rows = torch.from_numpy(tokens).view(self.batch_size, self.seq_len + 1)
        per_rank = self.batch_size // self.world_size
        mine = rows[self.rank * per_rank : (self.rank + 1) * per_rank]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def node_batches(
    config: DataConfig,
    *,
    vocab_size: int,
    node_key: bytes,
    batch_size: int,
    seq_len: int,
    rank: int,
    world_size: int,
) -> Batches:
    """The batches of one rank of the node whose key is `node_key`."""
    tokenizer = load_tokenizer(config, vocab_size)
    first = config.shard if config.shard is not None else shard_for_node(node_key, config.num_shards)
    if first >= config.num_shards:
        raise DataError(f"data.shard ({first}) must be below data.num_shards ({config.num_shards})")
    files = node_file_order(list_files(config), config.num_shards, first)
    count = min(config.interleave, len(files))
    streams = [TokenStream(files[j::count], tokenizer, config.text_field) for j in range(count)]
    return Batches(streams, batch_size=batch_size, seq_len=seq_len, rank=rank, world_size=world_size)

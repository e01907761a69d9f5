"""The streaming data pipeline: corpus, shards, tokenizers, packing and an exact stream position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2ptrain.config import DataConfig
from p2ptrain.train.data import (
    Batches,
    ByteTokenizer,
    DataError,
    DataPosition,
    StreamPosition,
    TokenStream,
    list_files,
    load_tokenizer,
    node_batches,
    node_file_order,
    shard_for_node,
    shard_of,
)


def make_corpus(root: Path, files: int = 12) -> Path:
    root.mkdir()
    for index in range(files):
        (root / f"doc{index:02d}.txt").write_text(f"document {index} " * (index + 3))
    return root


@pytest.mark.procs
def test_embedded_corpus_is_the_standard_library() -> None:
    files = list_files(DataConfig())
    assert len(files) > 500
    assert any(key.endswith("/json/decoder.py") for key, _ in files)
    assert not any("site-packages" in path.parts for _, path in files)
    assert sum(path.stat().st_size for _, path in files) > 10_000_000


def test_every_file_once_and_each_node_starts_in_its_own_shard(tmp_path: Path) -> None:
    files = list_files(DataConfig(paths=[str(make_corpus(tmp_path / "c", 40))]))
    for first in (0, 3):
        order = node_file_order(files, 4, first)
        assert sorted(order) == sorted(path for _, path in files)
        keys = {path: key for key, path in files}
        assert shard_of(keys[order[0]], 4) == first
    assert shard_for_node(b"a" * 32, 64) == shard_for_node(b"a" * 32, 64)  # stable across restarts
    assert len({shard_for_node(bytes([i]) * 32, 64) for i in range(20)}) > 10


def test_resume_from_a_position_continues_the_same_tokens(tmp_path: Path) -> None:
    paths = [path for _, path in list_files(DataConfig(paths=[str(make_corpus(tmp_path / "c"))]))]
    first = TokenStream(paths, ByteTokenizer())
    first.take(1000)
    saved = StreamPosition.from_dict(json.loads(json.dumps(first.position.to_dict())))
    expected = first.take(5000)  # crosses several files and wraps around the corpus
    second = TokenStream(paths, ByteTokenizer())
    second.seek(saved)
    assert (second.take(5000) == expected).all()
    assert saved.files_done > 0


def test_documents_are_separated_by_end_of_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("ab")
    stream = TokenStream([tmp_path / "a.txt"], ByteTokenizer())
    assert stream.take(6).tolist() == [97, 98, 0, 97, 98, 0]


def batches(config: DataConfig, *, batch_size: int = 4, rank: int = 0, world_size: int = 1) -> Batches:
    """A rank's batches of 16-token sequences for the node of key b"x" * 32, bytes as tokens."""
    return node_batches(
        config,
        vocab_size=256,
        node_key=b"x" * 32,
        batch_size=batch_size,
        seq_len=16,
        rank=rank,
        world_size=world_size,
    )


def test_ranks_split_the_node_batch(tmp_path: Path) -> None:
    config = DataConfig(paths=[str(make_corpus(tmp_path / "c"))])
    whole = batches(config)
    halves = [batches(config, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(3):
        inputs, targets = whole.next()
        parts = [half.next() for half in halves]
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    with pytest.raises(DataError, match="multiple of the local ranks"):
        Batches(whole.streams, batch_size=4, seq_len=16, rank=0, world_size=3)


def test_interleaved_batches_take_their_sequences_from_that_many_files_in_turn(tmp_path: Path) -> None:
    corpus = DataConfig(paths=[str(make_corpus(tmp_path / "c"))])
    order = node_file_order(list_files(corpus), corpus.num_shards, 0)
    one = batches(corpus.model_copy(update={"shard": 0}))
    alone = TokenStream(order, ByteTokenizer())  # interleave 1: the batches read as they always did
    for _ in range(5):
        assert (
            one.next()[0].flatten().tolist() == alone.take(4 * 17).reshape(4, 17)[:, :-1].flatten().tolist()
        )
    three = batches(corpus.model_copy(update={"shard": 0, "interleave": 3}))
    streams = [TokenStream(order[j::3], ByteTokenizer()) for j in range(3)]
    row = 0
    for _ in range(5):  # 4 sequences a batch from 3 streams: the turn goes on across batches
        for sequence in three.next()[0]:
            assert sequence.tolist() == streams[row % 3].take(17)[:-1].tolist()
            row += 1
    assert len(batches(corpus.model_copy(update={"interleave": 50})).streams) == 12


def test_interleaved_streams_resume_where_they_were(tmp_path: Path) -> None:
    corpus = DataConfig(paths=[str(make_corpus(tmp_path / "c"))], interleave=3)
    first = batches(corpus, batch_size=5)
    for _ in range(7):
        first.next()
    saved = DataPosition.from_dict(json.loads(json.dumps(first.position.to_dict())))
    expected = [first.next()[0] for _ in range(6)]
    second = batches(corpus, batch_size=5)
    assert second.seek(saved) and saved.turn == 35 % 3
    assert all(torch.equal(second.next()[0], batch) for batch in expected)
    other = batches(corpus.model_copy(update={"interleave": 2}), batch_size=5)
    assert not other.seek(saved)  # data.interleave changed: nothing moves
    assert other.position.streams == [StreamPosition(), StreamPosition()]
    old = DataPosition.from_dict({"files_done": 2, "offset": 7})  # saved before data.interleave
    assert old.streams == [StreamPosition(2, 7)] and old.turn == 0


def test_jsonl_records_skip_malformed_lines(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\nnot json\n{"other": 1}\n[1]\n{"text": "yo"}\n')
    files = list_files(DataConfig(paths=[str(tmp_path / "d.jsonl")]))
    stream = TokenStream([path for _, path in files], ByteTokenizer())
    assert bytes(stream.take(6).tolist()) == b"hi\0yo\0"


def test_bad_corpus_and_tokenizer_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        list_files(DataConfig(paths=[str(tmp_path / "missing")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable text files"):
        list_files(DataConfig(paths=[str(tmp_path / "empty")]))
    (tmp_path / "blank.txt").write_text("")
    stream = TokenStream([tmp_path / "blank.txt"], ByteTokenizer(eos_id=None))
    stream.take(3)  # an empty document still yields its end-of-text token
    with pytest.raises(DataError, match=r"model\.vocab_size is 100"):
        load_tokenizer(DataConfig(), vocab_size=100)
    with pytest.raises(DataError, match="not a file"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")), vocab_size=256)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match=r"not a usable tokenizer\.json"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "bad.json")), vocab_size=256)


def test_hugging_face_tokenizer_file(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the optional 'tokenizers' package is not installed"
    )
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")), vocab_size=256)
    assert loaded.eos_id == 1
    assert loaded.encode("hello world zebra").tolist() == [2, 3, 0]

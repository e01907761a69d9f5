"""Catching up by replay: the encoded results of recent all-reduces, for nodes a step or two behind.

Every member of outer step N decodes the same int8 (or int4) bytes into its averaged pseudo-gradient
(comm/ring.py), so those bytes — about a quarter of the fp32 vector — are an exact record of the
step. A node that fell behind (a joiner whose checkpoint download took longer than an outer step, a
straggler left out of a step) fetches them from a member that did the step and takes the same
Nesterov step from the same θ_outer and momentum: it lands on bit-identical params without
downloading a whole checkpoint again, over a slow link often the difference between catching up
and chasing the swarm forever. The outcome is checked by the params hash the swarm publishes: a
node whose hash then differs from the majority's fetches a full checkpoint (TrainingNode's
off-track check).

Served by the checkpoint sidecar as GET /delta/{step}: a u32 header length, a msgpack header
{"step", "numel", "block", "bits", "chunks": [[start, stop], …]}, then each chunk's payload (quant.py's wire
encoding) in that order.

Under the sparse codec no member holds an encoded mean: each computed it from every member's share
(comm/reduce/gather.py). Its record is then those shares and the weights every member gave them:
header {"step", "numel", "codec": "sparse", "chunk", "k", "weights": [w₀, …]}, then each member's
share (codec/sparse.py's payload) in member order; decoding it is the members' own sum, the same
floats.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import msgpack
import numpy as np

from p2ptrain.ckpt.fetch import checkpoint_source, read_body, stall_timeout
from p2ptrain.comm.codec import quant, sparse
from p2ptrain.swarm.election import swarm_ahead
from p2ptrain.swarm.records import Heartbeat
from p2ptrain.untrusted import unpack_untrusted

log = logging.getLogger(__name__)

_HEADER_LENGTH = struct.Struct("<I")
MAX_HEADER = 1 << 20
"""Bound on the header (a few bytes per chunk: 4 MiB chunks leave room for a 10¹¹-value model)."""


class ReplayError(ValueError):
    """A stored result is malformed or not the one asked for."""


def pack_result(
    step: int, numel: int, *, block: int, chunks: Sequence[tuple[int, int, quant.Buffer]], bits: int = 8
) -> bytes:
    """Serialize the encoded chunks (start, stop, payload) of step `step`'s result."""
    ordered = sorted(chunks, key=lambda chunk: chunk[0])
    spans = [[a, b] for a, b, _ in ordered]
    header = msgpack.packb({"step": step, "numel": numel, "block": block, "bits": bits, "chunks": spans})
    return b"".join([_HEADER_LENGTH.pack(len(header)), header, *(payload for _, _, payload in ordered)])


MAX_SPARSE_MEMBERS = 256
"""The most members a sparse step's record may hold shares of (its size bound: about 7.5 bytes a
parameter at the default code; the sparse codec's bytes pass the dense ring's at about 70)."""


def pack_sparse_result(
    step: int,
    numel: int,
    *,
    code: sparse.SparseCode,
    shares: Sequence[quant.Buffer],
    weights: Sequence[float],
) -> bytes:
    """Serialize a sparse step: every member's share and weight, in member order."""
    header = msgpack.packb(
        {
            "step": step,
            "numel": numel,
            "codec": "sparse",
            "chunk": code.chunk,
            "k": code.k,
            "weights": list(weights),
        }
    )
    return b"".join([_HEADER_LENGTH.pack(len(header)), header, *(bytes(share) for share in shares)])


def max_result_bytes(
    numel: int, block: int, *, chunk_values: int, bits: int = 8, code: sparse.SparseCode | None = None
) -> int:
    """Upper bound on a packed result of `numel` values (for bounded reads); `code`: a sparse step's."""
    if code is not None:
        return _HEADER_LENGTH.size + MAX_HEADER + MAX_SPARSE_MEMBERS * code.payload_size(numel)
    chunks = numel // max(1, chunk_values) + 64
    return _HEADER_LENGTH.size + MAX_HEADER + quant.payload_size(numel, block, bits) + 8 * chunks


def unpack_into(
    data: bytes,
    step: int,
    *,
    buffer: np.ndarray,
    block: int,
    bits: int = 8,
    code: sparse.SparseCode | None = None,
) -> None:
    """Decode a packed result of `step` into `buffer` (fp32, the whole vector); ReplayError if the
    data is malformed, of another step, or does not cover the vector exactly once. `code`: the
    run's sparse code, whose records are the members' shares (a dense record is then refused)."""
    if len(data) < _HEADER_LENGTH.size:
        raise ReplayError("truncated result")
    (size,) = _HEADER_LENGTH.unpack_from(data)
    if size > MAX_HEADER or _HEADER_LENGTH.size + size > len(data):
        raise ReplayError(f"bad header length {size}")
    body_start = _HEADER_LENGTH.size + size
    try:
        header = unpack_untrusted(data[_HEADER_LENGTH.size : body_start], MAX_HEADER, MAX_HEADER)
    except Exception as exc:
        raise ReplayError(f"malformed header ({exc})") from None
    if not isinstance(header, dict) or (header.get("codec") == "sparse") != (code is not None):
        raise ReplayError(f"a result of another codec than this run's ({'sparse' if code else 'dense'})")
    if code is not None:
        _unpack_sparse(memoryview(data)[body_start:], header, step=step, buffer=buffer, code=code)
        return
    try:
        chunks = [(int(a), int(b)) for a, b in header["chunks"]]
        got = (int(header["step"]), int(header["numel"]), int(header["block"]), int(header["bits"]))
    except Exception as exc:
        raise ReplayError(f"malformed header ({exc})") from None
    wanted = (step, buffer.shape[0], block, bits)
    if got != wanted:
        raise ReplayError(f"result of (step, values, block, bits) {got}, wanted {wanted}")
    offset, position = body_start, 0
    decoded: list[tuple[int, int, quant.Encoded]] = []
    for start, stop in chunks:
        if start != position or stop <= start:
            raise ReplayError(f"chunk [{start}, {stop}) does not continue at {position}")
        length = quant.payload_size(stop - start, block, bits)
        try:
            encoded = quant.decode_payload(
                data[offset : offset + length], stop - start, block=block, bits=bits
            )
        except quant.PayloadError as exc:
            raise ReplayError(str(exc)) from None
        decoded.append((start, stop, encoded))
        offset, position = offset + length, stop
    if position != buffer.shape[0] or offset != len(data):
        left = len(data) - offset
        raise ReplayError(f"result covers {position} of {buffer.shape[0]} values, {left} bytes left over")
    quant.dequantize_chunks(decoded, buffer)  # only once all of it checked out: the buffer stays intact


def _unpack_sparse(
    body: memoryview, header: dict, *, step: int, buffer: np.ndarray, code: sparse.SparseCode
) -> None:
    """A sparse step's record (see the module docstring) into `buffer`: every share with a weight
    is checked before the buffer is touched, then summed as the members summed them."""
    numel = buffer.shape[0]
    try:
        got = (int(header["step"]), int(header["numel"]), int(header["chunk"]), int(header["k"]))
        weights = [float(weight) for weight in header["weights"]]
    except Exception as exc:
        raise ReplayError(f"malformed header ({exc})") from None
    if got != (step, numel, code.chunk, code.k):
        raise ReplayError(
            f"result of (step, values, chunk, k) {got}, wanted {(step, numel, code.chunk, code.k)}"
        )
    size = code.payload_size(numel)
    if not 1 <= len(weights) <= MAX_SPARSE_MEMBERS or len(body) != size * len(weights):
        raise ReplayError(f"{len(body)} bytes of shares for {len(weights)} members of {size} bytes each")
    if not all(np.isfinite(weight) and 0 <= weight <= 1 for weight in weights):
        raise ReplayError("a member's weight is not within [0, 1]")
    shares = [body[member * size : (member + 1) * size] for member in range(len(weights))]
    for share, weight in zip(shares, weights, strict=True):
        if weight:
            try:
                sparse.squared_norm(share, numel, code)
            except quant.PayloadError as exc:
                raise ReplayError(str(exc)) from None
    sparse.weighted_sum(shares, weights, buffer, code)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The encoded chunks (start, stop, payload) of one step's result, as the ring left them."""

    numel: int
    block: int
    chunks: Sequence[tuple[int, int, quant.Buffer]]
    bits: int = 8
    code: sparse.SparseCode | None = None
    """The sparse codec's: then `shares` and `weights` are the step's record, `chunks` empty."""
    shares: Sequence[quant.Buffer] = ()
    weights: Sequence[float] = ()


class RecentResults:
    """The results of the last `keep` outer steps this node took part in (in RAM).

    Kept as the ring's own chunks (no copy on the outer step's path) and packed only when a node
    behind asks for one."""

    def __init__(self, keep: int):
        self.keep = keep
        self._results: OrderedDict[int, StepResult] = OrderedDict()

    def add(self, step: int, result: StepResult) -> None:
        if self.keep <= 0 or not (result.chunks or result.shares):  # a one-member step has none
            return
        self._results[step] = result
        while len(self._results) > self.keep:
            self._results.popitem(last=False)

    def packed(self, step: int) -> bytes | None:
        """The result of `step` in the /delta format, or None when it is not kept."""
        result = self._results.get(step)
        if result is None:
            return None
        if result.code is not None:
            return pack_sparse_result(
                step, result.numel, code=result.code, shares=result.shares, weights=result.weights
            )
        return pack_result(step, result.numel, block=result.block, chunks=result.chunks, bits=result.bits)


def result_sources(beats: Iterable[Heartbeat], step: int) -> list[str]:
    """Sidecar URLs of the nodes past `step` (their all-reduce of it is done, its result kept a
    while) whose sidecars can be reached."""
    return [b.ckpt_addr.rstrip("/") for b in beats if b.outer_step > step and checkpoint_source(b)]


async def fetch_result(urls: Sequence[str], step: int, *, limit: int, timeout: float) -> bytes | None:
    """The packed result of `step` from the first of `urls` (sidecar base URLs) that serves it."""
    async with aiohttp.ClientSession(timeout=stall_timeout(timeout)) as session:
        for url in urls:
            try:
                async with session.get(f"{url}/delta/{step}") as response:
                    if response.status != 200:
                        continue
                    body = await read_body(response, limit)
                    if len(body) <= limit:
                        return body
                    log.warning("%s: result of step %d larger than %d bytes; skipped", url, step, limit)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                log.warning("%s: no result of step %d (%s)", url, step, exc)
    return None


COLLECT_TRIES = 3
"""Tries (a heartbeat interval apart) at a step's result before the collector moves on without it."""


class ResultCollector:
    """The results of the outer steps the swarm takes while this node downloads a checkpoint.

    Members keep only their last `checkpoint.replay_steps` results. A download that spans more
    steps than that (a joiner on a slow link: a checkpoint is ~16 bytes a parameter, a result 1)
    used to end with the swarm past every result kept, so the node downloaded a newer checkpoint,
    and again, chasing the swarm. Each result is fetched here as soon as a member has it, and
    replayed from here once the checkpoint is loaded. At most `max_bytes` are kept (then collecting
    stops: the steps after would be no use without the ones before)."""

    def __init__(
        self,
        peers: Callable[[], Awaitable[list[Heartbeat]]],
        limit: int,
        *,
        max_bytes: int,
        timeout: float,
        interval: float,
    ):
        self._peers = peers
        self._limit = limit
        self._timeout = timeout
        self._interval = interval
        self.max_bytes = max_bytes
        self._results: dict[int, bytes] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self, first_step: int) -> None:
        """Collect the results of `first_step` on (once); the caller stops it."""
        if self._task is None:
            self._task = asyncio.create_task(self._collect(max(0, first_step)))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._results.clear()

    @property
    def kept(self) -> int:
        return len(self._results)

    @property
    def collecting(self) -> bool:
        return self._task is not None and not self._task.done()

    def take(self, step: int) -> bytes | None:
        """The result of `step`, if collected; older ones are dropped (never needed again)."""
        for older in [kept for kept in self._results if kept < step]:
            del self._results[older]
        return self._results.pop(step, None)

    async def _collect(self, step: int) -> None:
        """Each round, every result of a step the swarm is past and not collected yet: a step that
        no member serves (yet) is tried again the next rounds, up to COLLECT_TRIES, without holding
        up the steps after it, which members keep only a while (a fast swarm takes several steps
        a round)."""
        tries: dict[int, int] = {}
        """Steps past whose result is not collected yet, and the rounds that tried them."""
        while True:
            try:
                beats = await self._peers()
            except Exception as exc:  # a DHT read that failed: the next one may not
                log.info("result collector: could not read the swarm (%s)", exc)
                await asyncio.sleep(self._interval)
                continue
            # a strict majority past `step` has done its all-reduce (one record claiming a far step, a
            # stranger's, moves nothing on); a member past it keeps its result a while
            while swarm_ahead(beats, step, me=b""):
                tries[step], step = 0, step + 1
            for wanted in sorted(tries):
                packed = await fetch_result(
                    result_sources(beats, wanted), wanted, limit=self._limit, timeout=self._timeout
                )
                if packed is None:
                    tries[wanted] += 1
                    if tries[wanted] >= COLLECT_TRIES:
                        log.info("no member served the result of step %d: not collected", wanted)
                        del tries[wanted]
                    continue
                del tries[wanted]
                held = sum(len(result) for result in self._results.values())
                if held + len(packed) > self.max_bytes:
                    log.warning("collected results hold %d bytes: no more are collected", held)
                    return
                self._results[wanted] = packed
            await asyncio.sleep(self._interval)

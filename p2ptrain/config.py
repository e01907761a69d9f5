"""Typed configuration: pydantic models filled from a TOML file, then P2PTRAIN_* variables, then flags.

Precedence, lowest first: model defaults < TOML file < environment < command-line `--set`.
Environment names map onto the nesting with a double underscore:
`P2PTRAIN_SWARM__HEARTBEAT_INTERVAL=2` sets `swarm.heartbeat_interval`.
Values from the environment and from `--set key=value` are parsed as TOML values
(`2`, `1e-3`, `true`, `"text"`, `[1, 2]`); anything that does not parse is taken as a string.

A field marked `SHARED` must hold the same value on every node of a run: those fields make up
`Config.shared()`, whose hash every heartbeat carries and every joiner compares. The others are
each node's own (its hardware, its addresses, its patience). Each field's docstring is its
documentation: docs/configuration.md is generated from them (`python -m p2ptrain.config_reference`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from p2ptrain.config_files import describe, env_overrides, flag_overrides, read_toml, set_dotted
from p2ptrain.errors import ConfigError

Topology = Literal["auto", "ring", "butterfly"]
Robust = Literal["auto", "off", "clip", "reweighted"]
Aggregation = Literal["off", "clip", "reweighted"]
Codec = Literal["dense", "sparse"]
"""comm.topology: the reduce-scatter path (auto: the ring at 3 members or fewer, else butterfly)."""

MAX_CONNECTIONS = 16
"""comm.connections' bound: the handshake takes lanes up to twice it (the upper half reversed)."""
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The bundled configs (`--config debug`): package data, so an installed p2ptrain has them too."""


class Shared:
    """Marks a field every node of a run must share (`Annotated[T, SHARED]`): it is in the digest."""

    def __repr__(self) -> str:
        return "SHARED"


SHARED = Shared()


class Section(BaseModel):
    """Every section refuses unknown keys, so a typo is an error rather than a silent default.
    Field docstrings become the fields' descriptions (the generated reference reads them)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    def shared(self) -> dict[str, Any]:
        """The values of this section's SHARED fields, and of its sub-sections' (nested)."""
        found: dict[str, Any] = {}
        dumped = self.model_dump()
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if isinstance(value, Section):
                inner = value.shared()
                if inner:
                    found[name] = inner
            elif is_shared(field.metadata):
                found[name] = dumped[name]
        return found


def is_shared(metadata: list[Any]) -> bool:
    """Whether a field's metadata (pydantic's FieldInfo.metadata) holds the SHARED mark."""
    return any(isinstance(item, Shared) for item in metadata)


class RunConfig(Section):
    id: Annotated[str, SHARED] = Field(
        "p2ptrain-debug", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$"
    )
    """Name shared by every node of one training run; records of other runs are ignored."""
    authority: Annotated[str, SHARED] = Field("", pattern=r"^([0-9a-f]{64})?$")
    """Ed25519 public key (hex) of whoever admits nodes (`p2ptrain admit`); empty: an open run."""

    @property
    def authority_key(self) -> bytes | None:
        return bytes.fromhex(self.authority) if self.authority else None


class NodeConfig(Section):
    work_dir: str = "~/.local/share/p2ptrain/node"
    """Where the node keeps its identity, checkpoints and logs."""
    identity: str | None = None
    """Directory holding node.key (Ed25519) and p2p.key (libp2p); default: work_dir."""
    listen: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    """libp2p listen multiaddresses of the DHT."""
    announce: list[str] = []
    """Multiaddresses other peers should dial (public address behind NAT or in a container)."""
    data_host: str = "0.0.0.0"
    """Interface the data plane (all-reduce) listens on."""
    data_port: int = Field(0, ge=0, lt=65536)
    """TCP port of the data plane; 0 picks a free one."""
    data_announce: str = ""
    """host:port others dial for the data plane; default: data_host and the port, where data_host is
    a wildcard the address of the interface that reaches the bootstrap peers (later corrected by
    the address the peers observe)."""
    ckpt_port: int = Field(0, ge=0, lt=65536)
    """TCP port of the checkpoint sidecar (HTTP, on data_host); 0 picks a free one."""
    ckpt_announce: str = ""
    """URL others fetch checkpoints from; default: http://<data-plane host>:<ckpt_port>."""
    dashboard: str = ""
    """Serve the status page at PORT (127.0.0.1) or HOST:PORT; empty: no page."""
    progress_interval: float = Field(30.0, gt=0, le=86400)
    """Seconds between two progress lines (outer step, inner step, loss, tokens/s) of a training
    node whose output is not a terminal (systemd, nohup, a log file); a terminal gets a live bar."""
    relay_mbps: float = Field(100.0, gt=0, le=100000)
    """Cap on the bytes this node relays between members behind NAT, in Mbit/s (both ways)."""
    serve_mbps: float = Field(0.0, ge=0, le=100000)
    """Cap on the checkpoint files this node serves to joiners, in Mbit/s (0: none): on a slow uplink,
    what keeps a joiner's download from slowing the swarm's all-reduce (it runs meanwhile)."""
    ticket: str = ""
    """This node's admission ticket for a closed run (`p2ptrain admit` prints it)."""
    nproc: int = Field(0, ge=0, le=64)
    """Trainer ranks on this node; 0: one per visible GPU, one on a CPU-only machine."""

    @property
    def identity_dir(self) -> Path:
        """Where node.key and p2p.key live: `identity`, or else `work_dir`."""
        return Path(self.identity or self.work_dir).expanduser()


class SwarmConfig(Section):
    peers: list[str] = []
    """Bootstrap multiaddresses (also from --peer or the PEER environment variable)."""
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    """Seconds between two heartbeat records of this node."""
    heartbeat_timeout: float = Field(6.0, gt=0, le=600)
    """A node whose heartbeat sequence has not advanced for this long (on the reader's clock) is dead."""
    max_clock_skew: float = Field(30.0, ge=0, le=3600)
    """How far nodes' wall clocks may differ: heartbeat records stay in the DHT (whose expiration
    times are wall-clock) for heartbeat_timeout + this, and liveness never compares clocks."""
    dht_timeout: float = Field(5.0, gt=0, le=120)
    """Bound on every single DHT store or get."""
    connect_retries: int = Field(4, ge=1, le=100)
    """Tries to reach a bootstrap peer before the node gives up."""
    connect_backoff: float = Field(1.0, gt=0, le=60)
    """First retry delay in seconds; it doubles after each failed attempt."""
    shutdown_timeout: float = Field(5.0, gt=0, le=60)
    """Seconds a stopping node gives its DHT process (and p2pd) to end before it kills them."""
    straggler_deadline: float = Field(10.0, ge=0, le=3600)
    """Seconds after a node first sees a ready(N) record before step N goes on without the late ones.
    A node that sees no other node of its run at all waits two heartbeat intervals instead."""
    election_timeout: float = Field(120.0, gt=0, le=86400)
    """Bound on each wait for the swarm: one outer step's elections (then the step is given up),
    the start quorum (`wait_nodes`), a majority's view of the checkpoint to recover."""
    wait_nodes: int = Field(1, ge=1, le=10000)
    """A node starts training once this many live nodes (itself included) are in the swarm table."""
    sync_retries: int = Field(20, ge=1, le=1000)
    """Elections and all-reduces tried for one step before the node gives the step up."""
    push_records: bool = True
    """Push this node's ready records straight to the data ports of the step's nodes as well as
    storing them (comm/net/record_push.py), so elections decide without waiting for DHT round
    trips (docs/results/2026-12-control-plane.md). Off: the DHT alone carries them."""
    finish_grace: float = Field(60.0, ge=0, le=86400)
    """Seconds a node that finished the run stays in the swarm (state `finished`, still serving its
    checkpoint and recent all-reduce results) for nodes behind it to catch up; it leaves sooner
    once every node it knows of has finished."""

    @property
    def record_lifetime(self) -> float:
        """Seconds a heartbeat record lives in the DHT after its sender's clock says it was stored."""
        return self.heartbeat_timeout + self.max_clock_skew


class ModelConfig(Section):
    """Llama-style decoder shape; the trainer fills in the rest of the pipeline around it."""

    name: Annotated[str, SHARED] = "debug"
    """A label for the shape (the bundled configs name theirs)."""
    vocab_size: Annotated[int, SHARED] = Field(256, gt=0)
    """Token ids the embedding holds (256 for the byte tokenizer)."""
    dim: Annotated[int, SHARED] = Field(128, gt=0)
    """Width of the residual stream."""
    n_layers: Annotated[int, SHARED] = Field(2, gt=0)
    """Transformer blocks."""
    n_heads: Annotated[int, SHARED] = Field(4, gt=0)
    """Attention heads (dim must be a multiple)."""
    n_kv_heads: Annotated[int, SHARED] = Field(2, gt=0)
    """Key/value heads (grouped-query attention; n_heads must be a multiple)."""
    ffn_dim: Annotated[int, SHARED] = Field(352, gt=0)
    """Hidden width of each block's SwiGLU feed-forward."""
    seq_len: Annotated[int, SHARED] = Field(256, gt=0)
    """Tokens per training sequence."""
    tie_embeddings: Annotated[bool, SHARED] = True
    """The output layer reuses the input embedding's weights."""
    rope_theta: Annotated[float, SHARED] = Field(10000.0, gt=0)
    """Base of the rotary position embedding."""
    norm_eps: Annotated[float, SHARED] = Field(1e-5, gt=0)
    """Epsilon of the RMS norms."""


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model `config` describes, without building it (for the 10B shapes; and in
    the agent, which never imports torch)."""
    head_dim = config.dim // config.n_heads
    attention = 2 * config.dim * config.n_heads * head_dim + 2 * config.dim * config.n_kv_heads * head_dim
    block = attention + 3 * config.dim * config.ffn_dim + 2 * config.dim
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    return config.n_layers * block + embeddings + config.dim


def validate_shape(config: ModelConfig) -> None:
    """Raise ValueError naming the field when the shape cannot form a model (here, not in the model
    file, so that the agent checks it without importing torch)."""
    if config.dim % config.n_heads:
        raise ValueError(f"model.dim ({config.dim}) must be a multiple of model.n_heads ({config.n_heads})")
    if config.n_heads % config.n_kv_heads:
        raise ValueError(
            f"model.n_heads ({config.n_heads}) must be a multiple of model.n_kv_heads ({config.n_kv_heads})"
        )
    if (config.dim // config.n_heads) % 2:
        raise ValueError("model.dim / model.n_heads must be even for rotary embeddings")


class TrainConfig(Section):
    inner_steps: Annotated[int, SHARED] = Field(10, gt=0)
    """H: inner AdamW steps between two outer steps."""
    batch_size: int = Field(8, gt=0)
    """Sequences per inner step on this node (its own: a bigger node may take more, and its
    pseudo-gradient weighs by the tokens it processed)."""
    max_batch_size: Annotated[int, SHARED] = Field(256, gt=0)
    """The largest batch_size a node of this run may use (shared): a member's claimed tokens per
    outer step, its weight in the average, count at most max_batch_size × seq_len × inner_steps."""
    lr: Annotated[float, SHARED] = Field(1e-3, gt=0)
    """Peak learning rate of the inner AdamW (cosine decay after warm-up)."""
    weight_decay: Annotated[float, SHARED] = Field(0.1, ge=0)
    """Inner AdamW's decoupled weight decay."""
    warmup_steps: Annotated[int, SHARED] = Field(10, ge=0)
    """Inner steps of linear warm-up."""
    max_steps: Annotated[int, SHARED] = Field(200, gt=0)
    """Inner steps of the whole run (all its inner phases together): a node stops after the outer
    step that reaches it, so the run takes max_steps / inner_steps outer steps (more with time_box)."""
    grad_clip: Annotated[float, SHARED] = Field(1.0, gt=0)
    """Gradient norm clip of each inner step."""
    seed: Annotated[int, SHARED] = 0
    """Seed of the initial parameters (every node starts from the same ones)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16 autocast on GPU; CPU ranks always compute in fp32."""
    micro_batch: int | str = "auto"
    """Sequences per forward and backward pass on one rank: the rank's share of batch_size is run
    in passes of this many with their gradients accumulated (the same update as one pass, up to
    float summation order). "auto": the largest that the memory estimate says fits the memory the
    rank has (free GPU memory, or available RAM); `p2ptrain config show --memory` prints it."""
    loss_chunk: int | str = "auto"
    """Tokens per chunk of the output layer and loss: the chunks' logits are recomputed in the
    backward pass, so a large vocabulary's logits never exist all at once. "auto": as many tokens
    as fit in 64 MiB of fp32 logits (512 of a 32k vocabulary); 0: the whole micro-batch at once."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (less memory, about a third more
    compute)."""
    compile: bool = False
    """torch.compile each block (GPU runs; compile time dwarfs a CPU debug run)."""
    time_box: float = Field(0.0, ge=0)
    """Seconds after which an outer step starts even if fewer than inner_steps were done (0: off)."""

    @field_validator("micro_batch", "loss_chunk")
    @classmethod
    def _auto_or_a_count(cls, value: int | str) -> int | str:
        if isinstance(value, str) and value != "auto":
            raise ValueError("must be 'auto' or a number")
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 'auto' or a number ≥ 0")
        return value

    @model_validator(mode="after")
    def _batch_within_the_runs_limit(self) -> TrainConfig:
        if self.batch_size > self.max_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} exceeds the run's max_batch_size {self.max_batch_size}"
            )
        if isinstance(self.micro_batch, int) and not 1 <= self.micro_batch <= self.batch_size:
            raise ValueError(f"micro_batch must be 'auto' or 1 to batch_size ({self.batch_size})")
        return self


class DataConfig(Section):
    paths: list[str] = []
    """Text (.txt, .md, .py, …), .jsonl or .parquet files or folders; empty: the embedded corpus
    (the Python standard library's own .py sources on this machine)."""
    tokenizer: str = "bytes"
    """"bytes" (256 token ids, one per byte) or the path of a Hugging Face tokenizer.json."""
    text_field: str = "text"
    """Field holding the text in .jsonl records and .parquet columns."""
    num_shards: int = Field(64, ge=1, le=1 << 20)
    """Shards the corpus's files fall into by the hash of their names; a node reads its own shard
    first, then the others in turn."""
    shard: int | None = Field(None, ge=0)
    """This node's first shard; default: derived from the node key (stable across restarts)."""
    eos_id: int | None = Field(None, ge=0)
    """Token id put between documents; default: 0 for bytes, the tokenizer's end-of-text token."""
    interleave: int = Field(1, ge=1, le=256)
    """Files read at once: the sequences of a batch come from this many streams in turn (file j of
    the node's order in stream j mod K), so a batch mixes K documents rather than one long file's
    run. 1: one file after another. Each stream holds its current file's tokens in memory."""


class CheckpointConfig(Section):
    interval: int = Field(1, ge=0)
    """Save every this many outer steps (0: only at the end)."""
    keep: int = Field(3, ge=1)
    """Checkpoints kept on disk; older ones are removed."""
    dir: str = ""
    """Where checkpoints go; default: <work_dir>/checkpoints."""
    staging: str = "auto"
    """RAM folder training writes checkpoints to before they are copied to `dir` in the background:
    "auto" (/dev/shm where writable), "" (off: write to `dir` directly) or a path."""
    remote: str = ""
    """Also copy every checkpoint to this fsspec URL (s3://bucket/run, gs://…, file:///…); needs fsspec
    and the scheme's package."""
    fetch_timeout: float = Field(10.0, gt=0, le=600)
    """A peer that sends nothing for this long during a checkpoint download is left for another."""
    replay_steps: int = Field(2, ge=0, le=64)
    """All-reduce results of this many recent outer steps kept in RAM (about 1 byte per parameter
    each) and served to nodes that fell that far behind, instead of a whole checkpoint (ckpt/replay.py)."""


class MetricsConfig(Section):
    tensorboard: bool = False
    """Also log to TensorBoard (under <work_dir>/tensorboard) when the package is installed."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project when wandb is installed and logged in."""


class OverlapConfig(Section):
    """Syncing outer step N while the inner phase of N + 1 runs (train/overlap.py): the training
    loop waits on the network only when a sync takes longer than a whole inner phase."""

    enabled: Annotated[bool, SHARED] = False
    """Overlap the sync with the next inner phase; its result is applied in that phase
    (`take_on_arrival`, `steps`), at the latest at its end."""
    eager: Annotated[bool, SHARED] = True
    """The next phase starts from the step the node's own fresh pseudo-gradient would take, in
    place of the pending average; False: the step the last average would take."""
    start_correction: Annotated[float, SHARED] = Field(0.5, ge=0, le=1)
    """c: with the result taken at the phase's end, Δ − c·(y − θ_S) is handed over and is the next
    phase's estimate (y: where the phase started, θ_S: S's params once S took its step); taken τ
    steps in, the working weights keep 1 − c·τ/H of their shift onto S. 0: Δ as measured from y;
    1 diverged (docs/results/2026-12-quality.md)."""
    steps: Annotated[int, SHARED] = Field(0, ge=0, le=1_000_000)
    """Apply step N's result after this many inner steps of phase N + 1 (the time the sync has to
    hide in), moving the working weights by what the estimate missed; 0: at the end of that phase.
    Fewer steps: less staleness (closer to blocking DiLoCo's loss), less time to hide. With
    `take_on_arrival`, the earliest step it is taken after."""
    take_on_arrival: Annotated[bool, SHARED] = True
    """Take step N's result after the first inner step of phase N + 1 at whose end it is here (not
    before `steps`), at the latest at the phase's end: as little staleness as the sync's time
    allows, no wait. Where each node takes it is its own; S is the same. False: at `steps` (0: the
    phase's end) whenever it came."""


class OuterConfig(Section):
    lr: Annotated[float, SHARED] = Field(0.7, gt=0)
    """Outer learning rate of the Nesterov step on the averaged pseudo-gradient."""
    momentum: Annotated[float, SHARED] = Field(0.9, ge=0, lt=1)
    """Outer momentum."""
    nesterov: Annotated[bool, SHARED] = True
    """Nesterov momentum (False: heavy ball)."""
    overlap: OverlapConfig = OverlapConfig()
    """The sync of one step overlapped with the next inner phase (`outer.overlap = true` is short
    for `outer.overlap.enabled = true`)."""

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_on_or_off(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value


class CommConfig(Section):
    quant_block: Annotated[int, SHARED] = Field(256, ge=16, le=1 << 20, multiple_of=2)
    """Values per (min, step) pair of the code (even: a 4-bit block starts on a byte)."""
    bits: Annotated[Literal[4, 8], SHARED] = 8
    """Code width on the wire: 8, or 4 (about half the bytes, about 17× the error; quant.py)."""
    chunk_bytes: Annotated[int, SHARED] = Field(4 << 20, ge=1 << 12)
    """Pipelining unit of the ring all-reduce, in fp32 bytes (a quarter of that on the wire)."""
    connections: Annotated[int, SHARED] = Field(1, ge=1, le=MAX_CONNECTIONS)
    """Parallel TCP connections to each ring peer; chunks take them in turn (long fat links, where
    one connection's window cannot fill the pipe)."""
    zstd: Annotated[bool, SHARED] = False
    """zstd-compress every data frame (int8 codes of smooth values compress a little; costs CPU)."""
    failure_timeout: float = Field(5.0, gt=0, le=600)
    """Longest wait for the next frame (or for a peer to answer) before a step's attempt fails, on
    the fastest paths: an attempt with a member whose path this node measured longer waits 8 of its
    round trips instead, up to 4 × this (comm/net/paths.py). A member that crashes is seen at once
    whatever it is (its connections end); a frozen one after it."""
    slowest_link_mbit: float = Field(1.0, ge=0, le=100_000)
    """A frame in transit gets failure_timeout plus its bytes at this rate (Mbit/s per connection),
    so a large frame on a slow or shared uplink is not taken for a dead peer while one that sends
    nothing is; 0: failure_timeout alone, whatever the frame's size."""
    uplink_mbit: float = Field(0.0, ge=0, le=1_000_000)
    """This node's upload rate in Mbit/s (what a speed test says), or 0: not known. Known, the
    lanes a step sends on share 95 % of it (each capped by the kernel's pacing, split among those
    with bytes waiting: transport/pacing.py), so that several of them do not overflow the queue in
    front of the uplink; 0: each lane's congestion control alone. Set it a little under the
    measured rate: a cap above the uplink does nothing, one far below it wastes the difference
    (no lane is capped under `slowest_link_mbit`, which the peers' deadlines take as stalled)."""
    warm_lanes: bool = True
    """Keep each lane of a step that succeeded and re-bind it to the next step in one round trip
    (transport/resume.py) instead of three, without TCP's slow start; off: a fresh connection and
    handshake per lane and step."""
    topology: Annotated[Topology, SHARED] = "auto"
    """Reduce-scatter path: ring (neighbours only) or butterfly (straight to each segment's owner)."""
    robust: Annotated[Robust, SHARED] = "auto"
    """How the segments' owners aggregate the members' shares (comm/robust/, the butterfly):
    "reweighted" bounds each share's size (`clip`) and then takes a weighted mean that leaves out
    shares pointing away from the others' (around their coordinate-wise median), so a member
    counts as at most about one typical member in size and in direction; "clip": the size only;
    "off": the plain weighted mean (ring or butterfly). "auto": reweighted in
    an open run (no run.authority), off in a closed one, whose members an authority admitted.
    Every member checks each owner's sum against the members' signed norm claims. Under the sparse
    codec every member applies the rule itself to the shares it gathered (reduce/gather.py)."""
    clip: Annotated[float, SHARED] = Field(1.0, gt=0, le=1000)
    """Under robust aggregation, a member's share counts with a norm of at most `clip` × the median
    of the members' signed norm claims (weight-normalised), and at most its own claim."""

    codec: Annotated[Codec, SHARED] = "dense"
    """What members send: "dense", every value at `bits` (the ring or the butterfly); "sparse", the
    top `sparse_k` of every `sparse_chunk` values of an error-feedback accumulator at 2 bits, about
    0.23 bits per value, sent to every other member (codec/sparse.py, reduce/gather.py). Sparse
    sends (n − 1) shares per member: less than the dense ring up to a few dozen members (docs/05).
    It changes the outer step's defaults to SparseLoCo's: outer.momentum 0, outer.lr 1."""
    sparse_chunk: Annotated[int, SHARED] = Field(4096, ge=16, le=65536)
    """Sparse codec: values per chunk, a power of two (an index takes log2 of it in bits)."""
    sparse_k: Annotated[int, SHARED] = Field(64, ge=1, le=65536)
    """Sparse codec: values kept per chunk (64 of 4096: 1.6 %, 0.234 bits per value)."""
    error_feedback: Annotated[float, SHARED] = Field(0.95, ge=0, le=1)
    """Sparse codec: how much of each node's unsent accumulator carries into the next step (β)."""

    @field_validator("sparse_chunk")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _k_within_chunk(self) -> CommConfig:
        if self.sparse_k > self.sparse_chunk:
            raise ValueError(f"sparse_k ({self.sparse_k}) must be at most sparse_chunk ({self.sparse_chunk})")
        return self

    @field_validator("clip", mode="before")
    @classmethod
    def _clip_zero_was_off(cls, value: object) -> object:
        if value == 0:
            raise ValueError('0 no longer turns robust aggregation off: set comm.robust = "off"')
        return value

    @property
    def aggregation(self) -> Aggregation:
        """The rule in force. A run's Config settles "auto" when it is built (open or closed run);
        a CommConfig on its own (benchmarks, tests), with no run to ask, takes it as "off"."""
        return "off" if self.robust == "auto" else self.robust


class Config(Section):
    run: RunConfig = RunConfig()
    node: NodeConfig = NodeConfig()
    swarm: SwarmConfig = SwarmConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    outer: OuterConfig = OuterConfig()
    comm: CommConfig = CommConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _robust_by_default_in_open_runs(self) -> Config:
        """comm.robust "auto": an open run takes strangers' shares, so the reweighted mean; a closed
        run's operator admitted every member and keeps the plain mean unless they choose otherwise."""
        if self.comm.robust == "auto":
            self.comm.robust = "off" if self.run.authority else "reweighted"
        return self

    @model_validator(mode="after")
    def _sparseloco_outer_step(self) -> Config:
        """The sparse codec's error feedback stands in for the outer momentum (SparseLoCo): unless
        set, its outer step is plain SGD at lr 1 on the mean of the decoded shares."""
        if self.comm.codec == "sparse":
            if "momentum" not in self.outer.model_fields_set:
                self.outer.momentum = 0.0
            if "lr" not in self.outer.model_fields_set:
                self.outer.lr = 1.0
        return self

    def shared(self) -> dict[str, Any]:
        """What every member of a run must share (the SHARED fields, by section): run id, model,
        inner and outer optimisation, and the shape of the all-reduce."""
        return super().shared()

    def max_tokens(self) -> int:
        """The most tokens a member may claim for one outer step (its weight is capped there)."""
        return self.train.max_batch_size * self.model.seq_len * self.train.inner_steps

    def digest(self) -> str:
        """sha256 of `shared()`: published in every heartbeat, compared before a node joins."""
        return hashlib.sha256(json.dumps(self.shared(), sort_keys=True).encode()).hexdigest()


def config_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """'section.key is mine here, theirs in the swarm' for every shared setting that differs
    (`theirs` came from a peer: any shape is read without error)."""
    ours, other = _flatten(mine), _flatten(theirs)
    return [
        f"{key} is {ours.get(key)!r} here, {other.get(key)!r} in the swarm"
        for key in sorted(set(ours) | set(other))
        if ours.get(key) != other.get(key)
    ]


def _flatten(tree: dict[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Dotted key → value for every leaf of nested dicts (at most 4 deep; deeper ones are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and depth < 4:
            flat.update(_flatten(value, f"{dotted}.", depth + 1))
        else:
            flat[dotted] = value
    return flat


def bundled_configs() -> list[str]:
    """The names `--config` takes for the configs that ship with p2ptrain."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.toml"))


def resolve_config_path(name: str | os.PathLike[str]) -> Path:
    """A file that exists, as given (relative to the working directory), or else the bundled config
    of that name (`debug` or `debug.toml`, from any directory); a one-line ConfigError listing the
    bundled names otherwise."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{path.stem}.toml"
    if path.name == str(name) and path.suffix in ("", ".toml") and bundled.is_file():
        return bundled
    if path.exists():
        return path  # a folder, say: read_toml says what is wrong with it
    raise ConfigError(
        f"--config {name}: config file not found, and no bundled config has that name "
        f"(bundled: {', '.join(bundled_configs())})"
    )


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    options: Sequence[tuple[str, Any, str]] = (),
) -> Config:
    """Build the resolved Config; every problem raises ConfigError naming the key and its source.
    `options`: (dotted key, value, source) from a command's own flags (`--work-dir` and the like),
    applied last, already typed."""
    tree: dict[str, Any] = {}
    file_label = "defaults"
    if path is not None:
        resolved = resolve_config_path(path)
        tree = read_toml(resolved)
        file_label = str(resolved)
    # Validate the file alone first, so its errors name the file rather than an override.
    _validate(tree, file_label)
    layered = copy.deepcopy(tree)
    environ = os.environ if environ is None else environ
    for dotted, value, source in [*env_overrides(environ), *flag_overrides(list(overrides)), *options]:
        set_dotted(layered, dotted, value=value, source=source)
        _validate(layered, source)
    return _validate(layered, file_label)


def _validate(tree: dict[str, Any], source: str) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{source}: {describe(first)}{more}") from None

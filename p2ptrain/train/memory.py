"""How much memory one trainer rank needs, and the largest micro-batch that fits what a node has.

The estimate counts what the training loop allocates, part by part:

    params, grads    fp32, sharded over the local ranks (FSDP2), plus one unsharded block in flight
    optimizer        AdamW's two moments (fp32, sharded)
    outer state      DiLoCo's θ_outer and momentum, the shared Δ vector, the gathered θ and the
                     checkpoint snapshots (with overlap 2 or 3 vectors more, train/overlap.py): host
                     memory, on rank 0 (every rank gathers θ)
    activations      what autograd saves per token and layer (counted from the model's code: see
                     `saved_per_token_layer`; the test checks it against autograd's own saved tensors),
                     or only each block's input with activation checkpointing, plus one block's
                     activations while it is recomputed
    logits           the output layer's logits, log-softmax and its gradient (3 × tokens × vocab × 4
                     bytes), or one chunk of tokens at a time (`train.loss_chunk`)
    runtime          the Python interpreter and torch's own libraries (CPU ranks; a GPU's CUDA
                     context is outside the allocator and already taken from its free memory)

On a CPU rank everything is in RAM; on a GPU rank the outer state (and runtime) are in RAM and the
rest on the device. `benchmarks.memory` checks the estimate against measured peaks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from p2ptrain.config import Config, ModelConfig, parameter_count
from p2ptrain.memory_limits import current_rss, gib, ram_available

log = logging.getLogger(__name__)

LOSS_CHUNK_BYTES = 64 << 20
"""fp32 logits per chunk of the chunked loss: 512 tokens of a 32k vocabulary."""
CPU_RUNTIME_BYTES = 400 << 20
"""RSS of a rank before it builds anything: the interpreter, torch and its thread pools (measured
at 0.33-0.39 GiB with torch 2.13 on x86-64)."""
SAFETY = 0.9
"""`auto` plans for this share of the memory the node has: allocators fragment, estimates err."""


def loss_chunk_tokens(config: Config) -> int:
    """`train.loss_chunk` resolved: "auto" is at most LOSS_CHUNK_BYTES of fp32 logits; 0 is off."""
    chosen = config.train.loss_chunk
    if isinstance(chosen, int):
        return chosen
    return max(1, LOSS_CHUNK_BYTES // (4 * config.model.vocab_size))


def saved_per_token_layer(model: ModelConfig, half: bool) -> int:
    """Bytes autograd keeps per token for one block until its backward (model.py's Block).

    Each RMSNorm keeps its input, 1/rms and the normalised x (fp32) and the scaled output its linear
    layers read; attention keeps q, the repeated k and v, its output and the log-sum-exp per head;
    SwiGLU keeps w1·x, silu(w1·x), w3·x and their product. Under bf16 autocast the linear layers'
    inputs and outputs are bf16, the norms stay fp32."""
    act = 2 if half else 4
    norm = 3 * model.dim * 4 + 4 + (model.dim * act if half else 0)
    attention = 4 * model.dim * act + model.n_heads * 4
    feed_forward = 4 * model.ffn_dim * act
    return 2 * norm + attention + feed_forward


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one rank needs at its peak (an inner step after the first), by part."""

    micro_batch: int
    params: int
    grads: int
    optimizer: int
    outer_state: int
    activations: int
    logits: int
    runtime: int
    on_gpu: bool

    @property
    def device(self) -> int:
        """What lives on the rank's device (RAM as well, on a CPU rank)."""
        on_device = self.params + self.grads + self.optimizer + self.activations + self.logits
        return on_device if self.on_gpu else on_device + self.outer_state + self.runtime

    @property
    def host(self) -> int:
        """RAM on a GPU rank (the outer state and the runtime); on CPU, the same as `device`."""
        return self.outer_state + self.runtime if self.on_gpu else self.device

    def lines(self) -> list[str]:
        """`config show --memory`: one line per part, then the total (GiB)."""
        where = "GPU" if self.on_gpu else "RAM"
        parts = [
            ("params (fp32)", self.params),
            ("grads", self.grads),
            ("AdamW moments", self.optimizer),
            (f"activations (micro-batch {self.micro_batch})", self.activations),
            ("logits and loss", self.logits),
        ]
        rows = [f"  {name:<34} {gib(size):>9}  {where}" for name, size in parts]
        rows.append(f"  {'DiLoCo outer state (rank 0)':<34} {gib(self.outer_state):>9}  RAM")
        rows.append(f"  {'runtime (interpreter, torch)':<34} {gib(self.runtime):>9}  RAM")
        if self.on_gpu:
            rows.append(f"  {'total':<34} {gib(self.device):>9}  GPU, {gib(self.host)} RAM")
        else:
            rows.append(f"  {'total':<34} {gib(self.device):>9}  RAM")
        return rows


def estimate(
    config: Config, micro_batch: int, *, world_size: int = 1, on_gpu: bool = False
) -> MemoryEstimate:
    """The peak memory of rank 0 of a node with `world_size` local ranks, at `micro_batch`."""
    model = config.model
    total = parameter_count(model)
    block = parameter_count(model.model_copy(update={"n_layers": 1, "vocab_size": 1})) - 2 * model.dim
    in_flight = block * 4 if world_size > 1 else 0  # one all-gathered block's weights (and grads)
    shard = -(-total // world_size) * 4
    half = on_gpu and config.train.precision == "bf16"
    tokens = micro_batch * model.seq_len
    per_layer = saved_per_token_layer(model, half)
    if config.train.activation_checkpointing:
        activations = tokens * (model.n_layers * model.dim * 4 + per_layer)
    else:
        activations = tokens * model.n_layers * per_layer
    activations += tokens * (3 * model.dim * 4 + 4) + tokens * per_layer  # final norm; backward's grads
    logit_tokens = min(tokens, loss_chunk_tokens(config) or tokens)
    logits = 3 * logit_tokens * model.vocab_size * 4 + (logit_tokens * model.vocab_size * 2 if half else 0)
    # θ_outer, momentum, the shared Δ vector, the gathered θ, two checkpoint snapshot vectors; with
    # outer.overlap also the pending Δ and the phase's start (delayed: and the last average)
    overlap = (2 if config.outer.overlap.eager else 3) if config.outer.overlap.enabled else 0
    outer_state = (6 + overlap) * total * 4
    return MemoryEstimate(
        micro_batch=micro_batch,
        params=shard + in_flight,
        grads=shard + in_flight,
        optimizer=2 * shard,
        outer_state=outer_state,
        activations=activations,
        logits=logits,
        runtime=0 if on_gpu else CPU_RUNTIME_BYTES,
        on_gpu=on_gpu,
    )


def sequences_per_rank(config: Config, world_size: int) -> int:
    return max(1, config.train.batch_size // world_size)


def balanced_micro_batch(sequences: int, largest: int) -> int:
    """The micro-batch that needs the fewest passes of at most `largest`, split evenly."""
    passes = -(-sequences // max(1, largest))
    return -(-sequences // passes)


def choose_micro_batch(config: Config, available: int, *, world_size: int = 1, on_gpu: bool = False) -> int:
    """`train.micro_batch` resolved: the number given (at most the rank's share of the batch), or
    for "auto" the largest whose estimate fits SAFETY × `available` bytes (1 if none does)."""
    sequences = sequences_per_rank(config, world_size)
    chosen = config.train.micro_batch
    if chosen != "auto":
        return min(int(chosen), sequences)
    budget = SAFETY * available
    fits = [
        m
        for m in range(1, sequences + 1)
        if estimate(config, m, world_size=world_size, on_gpu=on_gpu).device <= budget
    ]
    return balanced_micro_batch(sequences, max(fits) if fits else 1)


def available_memory(device_type: str = "cpu", world_size: int = 1) -> int:
    """Bytes this rank may use: the GPU's free memory, or on CPU the RAM the kernel can give (its
    memory cgroup's limit included) shared by the node's ranks, plus what this process already
    holds (the estimate counts the rank's runtime)."""
    if device_type == "cuda":
        import torch  # here only: `config show --memory` on a CPU machine needs no CUDA

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    return ram_available() // max(1, world_size) + (current_rss() or 0)


def resolve_micro_batch(config: Config, world_size: int, device_type: str) -> tuple[int, MemoryEstimate, int]:
    """This rank's micro-batch, the estimate at it and the memory available to it; warns in the
    rank's log when the estimate does not fit."""
    on_gpu = device_type == "cuda"
    available = available_memory(device_type, world_size)
    micro = choose_micro_batch(config, available, world_size=world_size, on_gpu=on_gpu)
    found = estimate(config, micro, world_size=world_size, on_gpu=on_gpu)
    if found.device > available:
        log.warning(
            "memory: micro-batch %d needs about %s per rank, %s is available: it may run out",
            micro,
            gib(found.device),
            gib(available),
        )
    return micro, found, available


def memory_report(config: Config, world_size: int, *, device_type: str, available: int | None) -> list[str]:
    """`config show --memory`: the estimate per rank at the micro-batch this machine would use (the
    run's batch where `available` is None: another machine's device), the total at other
    micro-batches, and with activation checkpointing switched the other way."""
    on_gpu = device_type == "cuda"
    sequences = sequences_per_rank(config, world_size)
    if available is None:
        micro = (
            sequences
            if config.train.micro_batch == "auto"
            else choose_micro_batch(config, 0, world_size=world_size)
        )
        where = f"no {device_type} device here"
    else:
        micro = choose_micro_batch(config, available, world_size=world_size, on_gpu=on_gpu)
        where = f"{gib(available)} available per rank"
    chosen = estimate(config, micro, world_size=world_size, on_gpu=on_gpu)
    how = "auto" if config.train.micro_batch == "auto" else "set"
    lines = [
        f"memory per rank ({world_size} {'GPU' if on_gpu else 'CPU'} rank(s), {where}): "
        f"micro-batch {micro} of {sequences} sequences ({how})",
        *chosen.lines(),
    ]
    sizes = sorted(
        {1 << power for power in range(sequences.bit_length()) if 1 << power <= sequences} | {sequences}
    )
    lines.append(
        "  total by micro-batch: "
        + ", ".join(
            f"{size}: {gib(estimate(config, size, world_size=world_size, on_gpu=on_gpu).device)}"
            for size in sizes
        )
    )
    switched = not config.train.activation_checkpointing
    other = config.model_copy(
        update={"train": config.train.model_copy(update={"activation_checkpointing": switched})}
    )
    lines.append(
        f"  with train.activation_checkpointing = {str(switched).lower()}: "
        f"{gib(estimate(other, micro, world_size=world_size, on_gpu=on_gpu).device)} at micro-batch {micro}"
    )
    if available is not None and chosen.device > SAFETY * available:
        lines.append(f"  does not fit in the {gib(available)} available: expect to run out of memory")
    return lines

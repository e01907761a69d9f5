"""Does DiLoCo with int8 sync train as well as fp32 sync, and better than one node alone?

    python -m benchmarks.quality --json [--steps 300] [--seeds 1] [--tail 10] [--out DIR]
                                    [--set comm.robust=clip] [--only robust|bits|overlap|sparse]
                                    [--robust-nodes 3] [--attackers 1] [--cases mean,robust,...]
                                    [--config debug] [--device cpu|cuda] [--held-out-files K]

On the `debug` config over the embedded corpus, three runs of the same number of inner steps per
node: (a) 2 nodes averaging pseudo-gradients through the real int8 all-reduce (two data-plane
servers on 127.0.0.1 in this process), (a') the same 2 nodes averaging in exact fp32, (b) 1 node
alone (DiLoCo's outer step with itself). The loss that counts is measured on held-out batches
(another shard of the corpus) with the outer parameters every node agrees on, after every outer
step. A ratio compares the mean of that loss over the last `--tail` outer steps, summed over
`--seeds` runs (train.seed 0, 1, …, or from the one `--set train.seed=K` gives; each seed its own
node ids, so its own data order): one
evaluation swings by ±2 % from one outer step to the next on the debug model, more than the 1 %
some targets allow. loss_* are the means, of the last seed. `--tail 1` is the last evaluation
alone, as the figures measured before --tail were (seed 0 runs the node ids those runs had).
The held-out batches are 64 sequences read as the nodes read (with data.interleave = 1, from one
or two files of that shard); `--held-out-files K` takes them from K files in turn instead.

Reports int8_vs_fp32_loss_ratio (target within 2 % of 1) and diloco_vs_single_loss_ratio (< 1);
and, (a'') the same 2 nodes with 4-bit codes (comm.bits = 4), bits4_vs_int8_loss_ratio (target
within 1 % of 1).

And (a''') the same 2 nodes with the sparse codec (comm.codec = "sparse": chunk-wise top-k of an
error-feedback accumulator at 2 bits, SparseLoCo's outer step): sparse_vs_int8_loss_ratio (target
≤ 1.02), and the sparse codec with `outer.overlap` against it without (sparse_overlap_vs_sparse_loss_ratio);
`--only sparse` runs these three alone.

And (a'''') the same 2 nodes with `outer.overlap` (each step's average taken at the end of the next
inner phase, train/overlap.py): overlap_vs_blocking_loss_ratio (target within 1 % of 1), with the
start correction at its default (`--set outer.overlap.start_correction=0`: without it).
`--set outer.overlap.steps=K` takes it K inner steps in: what `outer.overlap.take_on_arrival` (on by default)
does where the sync takes K steps (benchmarks.swarm's taken_after_steps). Here, in one process, an
answer has no sync time to arrive after, so these runs take it at τ, take_on_arrival off.

Robust aggregation, `--robust-nodes` (3) nodes through the int8 all-reduce, `--cases` of them: the
plain weighted mean ("mean"), the run's rule ("robust": comm.robust, the reweighted mean in an open
run, `--set comm.robust=clip` for norm clipping alone; the butterfly, shares aggregated at the
owners), and that rule with the last `--attackers` (1) nodes poisoning from the first outer step:
sending 100 × their pseudo-gradient ("robust x100") or, P2PTRAIN_INJECT_ATTACK's kinds, the
opposite of their own, the opposite of the last shared result at their own norm, a random
direction at it, their own of 3 steps before, or zeros with their full token count ("robust
opposite", … "robust zero"); "mean x100" and "mean opposite" are two of them against the plain
mean, for scale. Reports robust_vs_mean_loss_ratio (target within 0.5 % of 1) and
<kind>_vs_honest_loss_ratio, each against the honest robust run (target ≤ 1.03).

Writes quality.csv and, with matplotlib installed, quality.png into --out.

On a GPU, the overlap's cost on a larger model (the nodes train one after another on the one
device; the outer step and the all-reduce stay on the host):

    python -m benchmarks.quality --json --only overlap --device cuda --config 150m --steps 300 \
        --set train.inner_steps=30 --set train.warmup_steps=30 --set train.batch_size=16
"""

from __future__ import annotations

import asyncio
import csv
import math
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from benchmarks.common import parser, report
from p2ptrain.channel import Averaged, Ready
from p2ptrain.comm.codec.sparse import ErrorFeedback
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.allreduce import all_reduce
from p2ptrain.comm.reduce.gather import sparse_code
from p2ptrain.config import CommConfig, Config, load_config
from p2ptrain.errors import UserError
from p2ptrain.faults import Poisoner
from p2ptrain.identity import load_or_create_identity
from p2ptrain.train.agent_link import AgentLink, SoloLink
from p2ptrain.train.data import node_batches
from p2ptrain.train.trainer import RankContext, Trainer, build_model

EVAL_BATCHES = 8
Averager = Callable[[list[torch.Tensor], list[int], int], None]
Curve = dict[int, float]
"""Outer step → held-out loss of the outer params after it."""


class RowWriter(Protocol):
    """What `csv.writer` returns, as far as the runs use it."""

    def writerow(self, row: Iterable[Any], /) -> Any: ...


def held_out(config: Config, files: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches from a shard no node starts in (data.shard pinned past the nodes' own), their
    sequences from `files` files in turn (0: as the nodes read, data.interleave)."""
    update = {"shard": config.data.num_shards - 1} | ({"interleave": files} if files else {})
    eval_data = config.data.model_copy(update=update)
    batches = node_batches(
        eval_data,
        vocab_size=config.model.vocab_size,
        node_key=b"eval",
        batch_size=8,
        seq_len=config.model.seq_len,
        rank=0,
        world_size=1,
    )
    return [batches.next() for _ in range(EVAL_BATCHES)]


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    device = next(model.parameters()).device
    losses = [float(model(inputs.to(device), targets.to(device))) for inputs, targets in batches]
    model.train()
    return sum(losses) / len(losses)


def tail_mean(curve: Curve, tail: int) -> float:
    """The mean held-out loss over the last `tail` outer steps (all of them where fewer)."""
    last = sorted(curve)[-tail:]
    return sum(curve[step] for step in last) / len(last) if last else math.nan


def node_id(index: int, seed: int) -> bytes:
    """Node `index`'s id in the run of `seed` (ids pick the data order; seed 0's as before seeds)."""
    return bytes([index]) * 31 + bytes([index ^ seed])


def exact_mean(buffers: list[torch.Tensor], weights: list[int], step: int) -> None:
    total = sum(weights)
    mean = torch.zeros_like(buffers[0], dtype=torch.float64)
    for buf, w in zip(buffers, weights, strict=True):
        mean += buf.double() * (w / total)
    mean = mean.float()
    for buf in buffers:
        buf.copy_(mean)


class Int8Ring:
    """The real int8 all-reduce between in-process members, each with its own server and key."""

    def __init__(
        self,
        count: int,
        root: Path,
        comm: CommConfig | None = None,
        poison: float = 1.0,
        attack: str = "",
        attackers: int = 1,
    ):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.poison = poison
        """The last `attackers` members multiply their pseudo-gradients by this (values finite)."""
        self.poisoners = [Poisoner.parse(f"1:{attack}", "attack") for _ in range(attackers)] if attack else []
        """The last members send wrong pseudo-gradients of this kind (faults.Poisoner) from step 1."""
        self.attackers = attackers
        self.references: list[np.ndarray | None] = [None] * count
        """Each member's last result (all_reduce's `reference`)."""
        self.identities = [load_or_create_identity(root / f"id{i}") for i in range(count)]
        comm = comm or CommConfig()
        self.feedbacks = [
            ErrorFeedback(code=sparse_code(comm), decay=comm.error_feedback)
            if comm.codec == "sparse"
            else None
            for _ in range(count)
        ]
        """Each member's error feedback under the sparse codec (as OuterSync keeps it)."""
        self.servers = [DataPlaneServer(identity=identity, comm=comm) for identity in self.identities]
        self.ports = [self.loop.run_until_complete(s.start("127.0.0.1", 0))[1] for s in self.servers]

    def __call__(self, buffers: list[torch.Tensor], weights: list[int], step: int) -> None:
        poisoned = buffers[len(buffers) - self.attackers :]
        if self.poison != 1.0:
            for buffer in poisoned:
                buffer.mul_(self.poison)
        for poisoner, buffer in zip(self.poisoners, poisoned, strict=False):
            poisoner.corrupt(step, buffer.numpy())
        members = [
            Member(key=identity.public_key, host="127.0.0.1", port=port, weight=float(weight))
            for identity, port, weight in zip(self.identities, self.ports, weights, strict=True)
        ]
        runs = [
            all_reduce(
                server, step=step, members=members, buffer=buf.numpy(), reference=reference, feedback=feedback
            )
            for server, buf, reference, feedback in zip(
                self.servers, buffers, self.references, self.feedbacks, strict=True
            )
        ]
        self.loop.run_until_complete(asyncio.gather(*runs))
        if self.servers[0].comm.aggregation == "reweighted":  # as OuterSync keeps it
            self.references = [buffer.numpy().copy() for buffer in buffers]
        for poisoner, buffer in zip(self.poisoners, poisoned, strict=False):
            poisoner.remember(buffer.numpy())

    def close(self) -> None:
        for server in self.servers:
            self.loop.run_until_complete(server.close())
        self.loop.close()


@dataclass(frozen=True)
class RobustCase:
    """One robust-aggregation run: the rule, and what its poisoners send."""

    robust: bool
    """The run's rule (comm.robust: reweighted unless set) where true; the plain mean where false."""
    poison: float = 1.0
    """The poisoners' factor on their own pseudo-gradient (P2PTRAIN_INJECT_SCALE's)."""
    attack: str = ""
    """What the poisoners send instead (P2PTRAIN_INJECT_ATTACK's kinds, faults.Poisoner)."""


ROBUST_CASES = {
    "mean": RobustCase(False),
    "robust": RobustCase(True),
    "robust x100": RobustCase(True, poison=100.0),
    **{f"robust {kind}": RobustCase(True, attack=kind) for kind in Poisoner.KINDS},
    "mean x100": RobustCase(False, poison=100.0),
    "mean opposite": RobustCase(False, attack="opposite"),
}
"""Robust aggregation's runs, `--robust-nodes` members of which `--attackers` poison from step 1."""


@dataclass(frozen=True)
class Bench:
    """What every run shares: a scratch folder, the csv rows, the device its nodes train on."""

    work: Path
    writer: RowWriter
    device: torch.device
    held_out_files: int = 0
    """The files the held-out sequences come from in turn (0: as the nodes read)."""
    robust_nodes: int = 3
    attackers: int = 1
    robust_cases: tuple[str, ...] = tuple(ROBUST_CASES)

    def trainer(self, name: str, config: Config, index: int, link: AgentLink | None = None) -> Trainer:
        """Node `index` of run `name` (its own folder under `work`)."""
        seed = config.train.seed
        folder = self.work / f"{name}-{seed}-{index}"
        return Trainer(
            config,
            node_key=node_id(index, seed),
            work_dir=folder,
            ctx=RankContext(device=self.device),
            link=link,
        )


def run(name: str, config: Config, nodes: int, average: Averager, bench: Bench) -> Curve:
    """Train `nodes` in lock-step; the held-out loss of the shared outer params after every step."""
    trainers = [bench.trainer(name, config, i) for i in range(nodes)]
    evaluation = held_out(config, bench.held_out_files)
    curve: Curve = {}
    while trainers[0].inner_step < config.train.max_steps:
        phases = [trainer.inner_phase() for trainer in trainers]
        readies = [
            trainer.prepare_outer(tokens) for trainer, (tokens, _) in zip(trainers, phases, strict=True)
        ]
        buffers = [t.leader.buffer for t in trainers if t.leader is not None]
        ready = [r for r in readies if r is not None]  # every trainer here is rank 0 of its node
        average(buffers, [r.tokens for r in ready], trainers[0].outer_step)
        hashes = {
            t.apply_outer(r, Averaged(r.outer_step, nodes)) for t, r in zip(trainers, ready, strict=True)
        }
        assert len(hashes) == 1, f"{name}: nodes diverged"
        loss = curve[trainers[0].outer_step] = eval_loss(trainers[0].model, evaluation)
        log_step(bench.writer, name, trainers[0], sum(p[1] for p in phases) / nodes, loss)
    return curve


def log_step(writer: RowWriter, name: str, trainer: Trainer, train_loss: float, loss: float) -> None:
    row = [name, trainer.config.train.seed, trainer.outer_step, trainer.inner_step, train_loss, loss]
    writer.writerow([round(value, 4) if isinstance(value, float) else value for value in row])
    print(f"{name}, seed {row[1]}: outer step {row[2]}, held-out loss {loss:.4f}", flush=True)


class Lockstep:
    """Overlap's exchange among in-process nodes: each hands its Δ of step N over (submit) and takes
    the average at the end of its next phase (collect); the first collect of N averages every
    node's Δ of N (all handed over by then: the nodes run their phases in turn)."""

    def __init__(self, average: Averager, nodes: int):
        self.average, self.nodes = average, nodes
        self.buffers: list[torch.Tensor] = []
        self.weights: dict[int, list[int]] = {}
        self.done: set[int] = set()

    def link(self, index: int) -> SoloLink:
        exchange = self

        class Link(SoloLink):
            def submit(self, ready: Ready) -> None:
                exchange.weights.setdefault(ready.outer_step, [0] * exchange.nodes)[index] = ready.tokens

            def collect(self, outer_step: int) -> Averaged:
                weights = exchange.weights[outer_step]
                if outer_step not in exchange.done:
                    exchange.average(exchange.buffers, weights, outer_step)
                    exchange.done.add(outer_step)
                return Averaged(outer_step, exchange.nodes)

        return Link()


def run_overlapped(name: str, config: Config, nodes: int, average: Averager, bench: Bench) -> Curve:
    """`run` with outer.overlap: every step's average is taken at the end of the next phase (or
    outer.overlap.steps into it), the phases in between start from the eager estimate. The curve
    is S's, step for step like `run`'s: θ_outer after each step once it is taken (its evaluation
    is a phase later than blocking's), then the last step's after the drain."""
    overlap = config.outer.overlap.model_copy(update={"enabled": True, "take_on_arrival": False})
    outer = config.outer.model_copy(update={"overlap": overlap})
    config = config.model_copy(update={"outer": outer})
    exchange = Lockstep(average, nodes)
    trainers = [bench.trainer(name, config, i, exchange.link(i)) for i in range(nodes)]
    exchange.buffers = [t.leader.buffer for t in trainers if t.leader is not None]
    evaluation = held_out(config, bench.held_out_files)
    outer_model = build_model(config, RankContext(device=bench.device))
    curve: Curve = {}

    def evaluate_outer(train_loss: float) -> None:
        """S's loss: θ_outer loaded into a model of its own (the nodes' hold working weights)."""
        leader = trainers[0]
        assert len({t.outer.params_hash() for t in trainers}) == 1, f"{name}: nodes diverged"
        if leader.outer_step not in curve:
            leader.layout.scatter(outer_model, leader.outer.params)
            curve[leader.outer_step] = eval_loss(outer_model, evaluation)
            log_step(bench.writer, name, leader, train_loss, curve[leader.outer_step])

    while trainers[0].inner_step < config.train.max_steps:
        phases = [trainer.inner_phase() for trainer in trainers]
        for trainer, (tokens, loss) in zip(trainers, phases, strict=True):
            trainer.outer_step_overlapped(tokens, loss)
        evaluate_outer(sum(p[1] for p in phases) / nodes)
    for trainer in trainers:
        trainer.drain_overlapped()
    evaluate_outer(math.nan)
    return curve


def plot(csv_path: Path, png_path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curves: dict[str, list[tuple[int, float]]] = {}
    with csv_path.open() as handle:
        for row in csv.DictReader(handle):
            run = row["run"] if row["seed"] == "0" else f"{row['run']}, seed {row['seed']}"
            curves.setdefault(run, []).append((int(row["outer_step"]), float(row["eval_loss"])))
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        axes.plot(*zip(*points, strict=True), label=name)
    axes.set_xlabel("outer step")
    axes.set_ylabel("held-out loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    return True


def rounded(value: float) -> float | None:
    """None for a run left out (--only): JSON has no NaN."""
    return None if math.isnan(value) else round(value, 4)


Runner = Callable[[str, Config, int, Averager, Bench], Curve]
"""`run` or `run_overlapped`."""


def sparse_config(config: Config) -> Config:
    """`config` with comm.codec = "sparse", and with it SparseLoCo's outer step where no --set chose
    outer.lr or outer.momentum (config.py); the robust rule is off, as in the int8 run it is compared to."""
    tree = config.model_dump(exclude_unset=True)
    tree.setdefault("comm", {}).update(codec="sparse", robust="off")
    return Config.model_validate(tree)


def seed_runs(config: Config, only: str | None, bench: Bench) -> dict[str, Curve]:
    """Every run `only` asks for, with config's train.seed: run name → curve."""
    curves: dict[str, Curve] = {}

    def through_ring(
        name: str,
        nodes: int,
        comm: CommConfig | None = None,
        poison: float = 1,
        runner: Runner = run,
        settings: Config = config,
    ) -> None:
        ring = Int8Ring(nodes, bench.work / f"{name.replace(' ', '-')}-{config.train.seed}", comm, poison)
        try:
            curves[name] = runner(name, settings, nodes, ring, bench)
        finally:
            ring.close()

    if only != "robust":
        through_ring("2 nodes int8", 2)
    if only in (None, "sparse"):
        sparse = sparse_config(config)
        through_ring("2 nodes sparse", 2, sparse.comm, settings=sparse)
        through_ring("2 nodes sparse overlap", 2, sparse.comm, settings=sparse, runner=run_overlapped)
    if only in (None, "bits"):
        through_ring("2 nodes int4", 2, CommConfig(bits=4))
    if only in (None, "overlap"):
        through_ring("2 nodes int8 overlap", 2, runner=run_overlapped)
    if only is None:
        curves["2 nodes fp32"] = run("2 nodes fp32", config, 2, exact_mean, bench)
        curves["1 node"] = run("1 node", config, 1, lambda buffers, weights, step: None, bench)
    for name, case in ROBUST_CASES.items() if only in (None, "robust") else ():
        if name not in bench.robust_cases:
            continue
        comm = config.comm if case.robust else config.comm.model_copy(update={"robust": "off"})
        members = bench.robust_nodes
        title = f"{members} nodes {name}"
        ring = Int8Ring(
            members,
            bench.work / f"{title.replace(' ', '-').replace(',', '')}-{config.train.seed}",
            comm,
            case.poison,
            case.attack,
            bench.attackers if case.poison != 1.0 or case.attack else 0,
        )
        try:
            curves[name] = run(title, config, members, ring, bench)
        finally:
            ring.close()
    return curves


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--steps", type=int, default=300, help="inner steps per node (default %(default)s)")
    cli.add_argument("--seeds", type=int, default=1, help="runs of each case: train.seed 0, 1, … or K, …")
    cli.add_argument("--tail", type=int, default=10, help="last outer steps averaged (default 10)")
    cli.add_argument("--out", default=".bench/quality", help="folder for quality.csv and quality.png")
    cli.add_argument(
        "--held-out-files",
        type=int,
        default=0,
        help="held-out sequences from this many files in turn (default: as the nodes read, data.interleave)",
    )
    cli.add_argument("--config", default="debug", help="the model and training settings (default debug)")
    cli.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the nodes train, one after another"
    )
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    cli.add_argument(
        "--only",
        choices=["robust", "bits", "overlap", "sparse"],
        help="only the robust runs, the int8 and int4 ones, int8 without and with overlap, int8 and sparse",
    )
    cli.add_argument("--robust-nodes", type=int, default=3, help="members of the robust runs (default 3)")
    cli.add_argument("--attackers", type=int, default=1, help="poisoners among them (default 1)")
    cli.add_argument(
        "--cases",
        default=",".join(ROBUST_CASES),
        help=f"the robust runs, comma-separated (default all: {', '.join(ROBUST_CASES)})",
    )
    args = cli.parse_args()
    cases = tuple(case.strip() for case in args.cases.split(","))
    if unknown := [case for case in cases if case not in ROBUST_CASES]:
        cli.error(f"--cases: no such run {unknown[0]!r} (known: {', '.join(ROBUST_CASES)})")
    if not 3 <= args.robust_nodes <= 16 or not 1 <= args.attackers < args.robust_nodes / 2:
        cli.error("--robust-nodes must be 3 to 16 and --attackers at least 1 and fewer than half of them")
    if args.seeds < 1 or args.tail < 1 or args.steps < 1:
        cli.error("--steps, --seeds and --tail must be at least 1")
    if not 0 <= args.held_out_files <= 256:
        cli.error("--held-out-files must be 0 to 256")
    torch.set_num_threads(2)
    overrides = [f"train.max_steps={args.steps}", "checkpoint.interval=0", 'checkpoint.staging=""', *args.set]
    if args.device == "cuda" and not torch.cuda.is_available():
        cli.error("--device cuda: torch sees no CUDA device here")
    try:
        config = load_config(args.config, overrides=overrides)
    except UserError as error:
        cli.error(str(error))
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sums: dict[str, float] = {}
    last: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, (out / "quality.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "seed", "outer_step", "inner_step", "train_loss", "eval_loss"])
        first = config.train.seed
        for seed in range(first, first + args.seeds):
            seeded = config.model_copy(update={"train": config.train.model_copy(update={"seed": seed})})
            bench = Bench(
                Path(tmp), writer, device, args.held_out_files, args.robust_nodes, args.attackers, cases
            )
            for name, curve in seed_runs(seeded, args.only, bench).items():
                last[name] = tail_mean(curve, args.tail)
                sums[name] = sums.get(name, 0.0) + last[name]
    plotted = plot(out / "quality.csv", out / "quality.png")

    def ratio(run: str, base: str) -> float | None:
        return rounded(sums.get(run, math.nan) / sums.get(base, math.nan))

    def loss(run: str) -> float | None:
        return rounded(last.get(run, math.nan))

    report(
        {
            "inner_steps": args.steps,
            "seeds": args.seeds,
            "tail": args.tail,
            "clip": config.comm.clip,
            "loss_int8": loss("2 nodes int8"),
            "loss_fp32": loss("2 nodes fp32"),
            "loss_single": loss("1 node"),
            "int8_vs_fp32_loss_ratio": ratio("2 nodes int8", "2 nodes fp32"),
            "diloco_vs_single_loss_ratio": ratio("2 nodes int8", "1 node"),
            "loss_int4": loss("2 nodes int4"),
            "bits4_vs_int8_loss_ratio": ratio("2 nodes int4", "2 nodes int8"),
            "loss_sparse": loss("2 nodes sparse"),
            "sparse_vs_int8_loss_ratio": ratio("2 nodes sparse", "2 nodes int8"),
            "loss_sparse_overlap": loss("2 nodes sparse overlap"),
            "sparse_overlap_vs_sparse_loss_ratio": ratio("2 nodes sparse overlap", "2 nodes sparse"),
            "loss_overlap": loss("2 nodes int8 overlap"),
            "overlap_vs_blocking_loss_ratio": ratio("2 nodes int8 overlap", "2 nodes int8"),
            "robust": config.comm.robust,
            "robust_nodes": args.robust_nodes,
            "attackers": args.attackers,
            "loss_robust_mean": loss("mean"),
            "loss_robust": loss("robust"),
            "robust_vs_mean_loss_ratio": ratio("robust", "mean"),
            **{
                f"{name.split(' ')[1]}_vs_honest_loss_ratio": ratio(name, "robust")
                for name in ROBUST_CASES
                if name.startswith("robust ")
            },
            "unprotected_x100_vs_honest_loss_ratio": ratio("mean x100", "mean"),
            "unprotected_opposite_vs_honest_loss_ratio": ratio("mean opposite", "mean"),
            "csv": str(out / "quality.csv"),
            "png": str(out / "quality.png") if plotted else None,
            "seconds": round(time.monotonic() - started, 1),
        },
        args.json,
    )


if __name__ == "__main__":
    main()

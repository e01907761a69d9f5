"""Does DiLoCo with int8 sync train as well as fp32 sync, and better than one node alone?

    python -m benchmarks.quality --json [--steps 300] [--out DIR] [--set comm.clip=1.5]
                                    [--only robust|bits|overlap]

On the `debug` config over the embedded corpus, three runs of the same number of inner steps per
node: (a) 2 nodes averaging pseudo-gradients through the real int8 all-reduce (two data-plane
servers on 127.0.0.1 in this process), (a') the same 2 nodes averaging in exact fp32, (b) 1 node
alone (DiLoCo's outer step with itself). The loss that counts is measured on held-out batches
(another shard of the corpus) with the outer parameters every node agrees on.

Reports int8_vs_fp32_loss_ratio (target within 2 % of 1) and diloco_vs_single_loss_ratio (< 1);
and, (a'') the same 2 nodes with 4-bit codes (comm.bits = 4), bits4_vs_int8_loss_ratio (target
within 1 % of 1).

And (a''') the same 2 nodes with `outer.overlap` (each step's average taken at the end of the next
inner phase, train/overlap.py): overlap_vs_blocking_loss_ratio (target within 1 % of 1).

Robust aggregation, 3 nodes through the int8 all-reduce: (c) the plain weighted mean, (d) with
`comm.clip` (1 unless set; butterfly, shares clipped at the owners), (e) the same with node 2
sending 100 × its pseudo-gradient from the first outer step, (f) that poisoner against the plain mean. Reports
clipped_vs_mean_loss_ratio = d / c (target within 0.5 % of 1) and poisoned_vs_honest_loss_ratio =
e / d (target ≤ 1.03), with loss_poisoned_unclipped for scale.

Writes quality.csv and, with matplotlib installed, quality.png into --out.
"""

from __future__ import annotations

import asyncio
import csv
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import parser, report
from p2ptrain.channel import Averaged, Ready
from p2ptrain.comm.dataplane import DataPlaneServer, RingSettings
from p2ptrain.comm.members import RingMember
from p2ptrain.comm.ring import ring_all_reduce
from p2ptrain.config import Config, load_config
from p2ptrain.identity import load_or_create_identity
from p2ptrain.train.agent_link import SoloLink
from p2ptrain.train.data import node_batches
from p2ptrain.train.trainer import RankContext, Trainer

EVAL_BATCHES = 8
Averager = Callable[[list[torch.Tensor], list[int], int], None]


def held_out(config: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches from a shard no node starts in (data.shard pinned past the nodes' own)."""
    eval_data = config.data.model_copy(update={"shard": config.data.num_shards - 1})
    batches = node_batches(eval_data, config.model.vocab_size, b"eval", 8, config.model.seq_len, 0, 1)
    return [batches.next() for _ in range(EVAL_BATCHES)]


@torch.no_grad()
def eval_loss(trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    trainer.model.eval()
    losses = [float(trainer.model(inputs, targets)) for inputs, targets in batches]
    trainer.model.train()
    return sum(losses) / len(losses)


def exact_mean(buffers: list[torch.Tensor], weights: list[int], step: int) -> None:
    total = sum(weights)
    mean = sum(buf.double() * (w / total) for buf, w in zip(buffers, weights, strict=True)).float()
    for buf in buffers:
        buf.copy_(mean)


class Int8Ring:
    """The real int8 all-reduce between in-process members, each with its own server and key."""

    def __init__(self, count: int, root: Path, settings: RingSettings | None = None, poison: float = 1.0):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.poison = poison
        """The last member multiplies its pseudo-gradient by this (a poisoner, values finite)."""
        self.identities = [load_or_create_identity(root / f"id{i}") for i in range(count)]
        settings = settings or RingSettings()
        self.servers = [DataPlaneServer(identity, settings) for identity in self.identities]
        self.ports = [self.loop.run_until_complete(s.start("127.0.0.1", 0))[1] for s in self.servers]

    def __call__(self, buffers: list[torch.Tensor], weights: list[int], step: int) -> None:
        if self.poison != 1.0:
            buffers[-1].mul_(self.poison)
        members = [
            RingMember(identity.public_key, "127.0.0.1", port, float(weight))
            for identity, port, weight in zip(self.identities, self.ports, weights, strict=True)
        ]
        runs = [
            ring_all_reduce(server, step, members, buf.numpy())
            for server, buf in zip(self.servers, buffers, strict=True)
        ]
        self.loop.run_until_complete(asyncio.gather(*runs))

    def close(self) -> None:
        for server in self.servers:
            self.loop.run_until_complete(server.close())
        self.loop.close()


def run(name: str, config: Config, nodes: int, average: Averager, work: Path, writer: csv.writer) -> float:
    """Train `nodes` in lock-step; returns the final held-out loss of the shared outer params."""
    trainers = [Trainer(config, bytes([i]) * 32, work / f"{name}-{i}", RankContext()) for i in range(nodes)]
    evaluation = held_out(config)
    loss = math.nan
    while trainers[0].inner_step < config.train.max_steps:
        phases = [trainer.inner_phase() for trainer in trainers]
        readies = [
            trainer.prepare_outer(tokens) for trainer, (tokens, _) in zip(trainers, phases, strict=True)
        ]
        buffers = [t.leader.buffer for t in trainers if t.leader is not None]
        average(buffers, [r.tokens for r in readies if r is not None], trainers[0].outer_step)
        hashes = {
            t.apply_outer(r, Averaged(r.outer_step, nodes)) for t, r in zip(trainers, readies, strict=True)
        }
        assert len(hashes) == 1, f"{name}: nodes diverged"
        loss = eval_loss(trainers[0], evaluation)
        train_loss = sum(p[1] for p in phases) / nodes
        writer.writerow(
            [name, trainers[0].outer_step, trainers[0].inner_step, round(train_loss, 4), round(loss, 4)]
        )
        print(f"{name}: outer step {trainers[0].outer_step}, held-out loss {loss:.4f}", flush=True)
    return loss


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


def run_overlapped(
    name: str, config: Config, nodes: int, average: Averager, work: Path, writer: csv.writer
) -> float:
    """`run` with outer.overlap: every step's average is taken at the end of the next phase, the
    phases in between start from the eager estimate; the loss is S's once the last step is in."""
    config = config.model_copy(update={"outer": config.outer.model_copy(update={"overlap": True})})
    exchange = Lockstep(average, nodes)
    trainers = [
        Trainer(config, bytes([i]) * 32, work / f"{name}-{i}", RankContext(), link=exchange.link(i))
        for i in range(nodes)
    ]
    exchange.buffers = [t.leader.buffer for t in trainers if t.leader is not None]
    evaluation = held_out(config)
    while trainers[0].inner_step < config.train.max_steps:
        phases = [trainer.inner_phase() for trainer in trainers]
        for trainer, (tokens, loss) in zip(trainers, phases, strict=True):
            trainer.overlapped.end_of_phase(tokens, loss)  # type: ignore[union-attr]
        assert len({t.outer.params_hash() for t in trainers}) == 1, f"{name}: nodes diverged"
        loss = eval_loss(trainers[0], evaluation)  # the working weights, mid-run
        train_loss = sum(p[1] for p in phases) / nodes
        writer.writerow(
            [name, trainers[0].outer_step, trainers[0].inner_step, round(train_loss, 4), round(loss, 4)]
        )
        print(f"{name}: outer step {trainers[0].outer_step}, held-out loss {loss:.4f}", flush=True)
    for trainer in trainers:
        trainer.overlapped.drain()  # type: ignore[union-attr]
    assert len({t.outer.params_hash() for t in trainers}) == 1, f"{name}: nodes diverged"
    return eval_loss(trainers[0], evaluation)  # S: the model holds θ_outer after the drain


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
            curves.setdefault(row["run"], []).append((int(row["inner_step"]), float(row["eval_loss"])))
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        axes.plot(*zip(*points, strict=True), label=name)
    axes.set_xlabel("inner steps per node")
    axes.set_ylabel("held-out loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    return True


def rounded(value: float) -> float | None:
    """None for a run left out (--only): JSON has no NaN."""
    return None if math.isnan(value) else round(value, 4)


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--steps", type=int, default=300, help="inner steps per node (default %(default)s)")
    cli.add_argument("--out", default=".bench/quality", help="folder for quality.csv and quality.png")
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    cli.add_argument(
        "--only",
        choices=["robust", "bits", "overlap"],
        help="only the 3-node robust runs, the int8 and int4 ones, or int8 without and with overlap",
    )
    args = cli.parse_args()
    torch.set_num_threads(2)
    overrides = [f"train.max_steps={args.steps}", "checkpoint.interval=0", 'checkpoint.staging=""', *args.set]
    config = load_config("debug", overrides=overrides)
    clip = config.comm.clip or 1.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, (out / "quality.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "outer_step", "inner_step", "train_loss", "eval_loss"])
        int8 = int4 = fp32 = single = overlapped = math.nan
        if args.only != "robust":
            ring = Int8Ring(2, Path(tmp))
            try:
                int8 = run("2 nodes int8", config, 2, ring, Path(tmp), writer)
            finally:
                ring.close()
        if args.only in (None, "bits"):
            ring = Int8Ring(2, Path(tmp) / "int4", RingSettings(bits=4))
            try:
                int4 = run("2 nodes int4", config, 2, ring, Path(tmp), writer)
            finally:
                ring.close()
        if args.only in (None, "overlap"):
            ring = Int8Ring(2, Path(tmp) / "overlap")
            try:
                overlapped = run_overlapped("2 nodes int8 overlap", config, 2, ring, Path(tmp), writer)
            finally:
                ring.close()
        if args.only is None:
            fp32 = run("2 nodes fp32", config, 2, exact_mean, Path(tmp), writer)
            single = run("1 node", config, 1, lambda buffers, weights, step: None, Path(tmp), writer)
        cases = {
            "3 nodes mean": (None, 1.0),
            "3 nodes clipped": (RingSettings(clip=clip), 1.0),
            "3 nodes clipped, one poisoner x100": (RingSettings(clip=clip), 100.0),
            "3 nodes mean, one poisoner x100": (None, 100.0),
        }
        robust = dict.fromkeys(cases, math.nan)
        for name, (settings, poison) in cases.items() if args.only in (None, "robust") else ():
            ring = Int8Ring(3, Path(tmp) / name.replace(" ", "-"), settings, poison)
            try:
                robust[name] = run(name, config, 3, ring, Path(tmp), writer)
            finally:
                ring.close()
    plotted = plot(out / "quality.csv", out / "quality.png")
    report(
        {
            "inner_steps": args.steps,
            "clip": clip,
            "loss_int8": rounded(int8),
            "loss_fp32": rounded(fp32),
            "loss_single": rounded(single),
            "int8_vs_fp32_loss_ratio": rounded(int8 / fp32),
            "diloco_vs_single_loss_ratio": rounded(int8 / single),
            "loss_int4": rounded(int4),
            "bits4_vs_int8_loss_ratio": rounded(int4 / int8),
            "loss_overlap": rounded(overlapped),
            "overlap_vs_blocking_loss_ratio": rounded(overlapped / int8),
            "loss_3_mean": rounded(robust["3 nodes mean"]),
            "loss_3_clipped": rounded(robust["3 nodes clipped"]),
            "loss_poisoned_clipped": rounded(robust["3 nodes clipped, one poisoner x100"]),
            "loss_poisoned_unclipped": rounded(robust["3 nodes mean, one poisoner x100"]),
            "clipped_vs_mean_loss_ratio": rounded(robust["3 nodes clipped"] / robust["3 nodes mean"]),
            "poisoned_vs_honest_loss_ratio": rounded(
                robust["3 nodes clipped, one poisoner x100"] / robust["3 nodes clipped"]
            ),
            "csv": str(out / "quality.csv"),
            "png": str(out / "quality.png") if plotted else None,
            "seconds": round(time.monotonic() - started, 1),
        },
        args.json,
    )


if __name__ == "__main__":
    main()

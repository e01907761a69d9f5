"""`p2ptrain demo`: a swarm that trains, loses a node, takes in a new one, on 127.0.0.1.

A bootstrap peer and N nodes train the `debug` model on the embedded corpus with DiLoCo and int8
sync. Partway through, one node is killed with SIGKILL and a new one starts: it recovers the
swarm's checkpoint from its peers and joins. The demo follows every outer step (members, ring
order, loss, all-reduce time and bytes), checks that every node that did a step holds the same
params hash after it, prints a summary and stops every process by PID, leaving none behind.
SIGINT and SIGTERM stop it the same way, through handlers of its own (`StopSignals`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from p2ptrain.ckpt.format import MANIFEST_FILE, latest_checkpoint
from p2ptrain.config import Config, load_config
from p2ptrain.errors import UserError
from p2ptrain.procs import ChildProcesses
from p2ptrain.train.metrics import read_metrics

INNER_STEPS = 10


@dataclass(frozen=True)
class Host:
    """Where one demo process runs: the IPv4 address it listens on, and a command prefix that puts
    it there (for example `ip netns exec NS` for a bandwidth-limited network namespace)."""

    ip: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    @property
    def listen(self) -> str:
        return f"/ip4/{self.ip}/tcp/0"


Placement = Callable[[str], Host]
"""Process name ('bootstrap', 'node0', …) → its host; the demo's own is 127.0.0.1 for all."""


def p2ptrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", *args]


class Interrupted(Exception):
    """SIGINT or SIGTERM came: the demo stops every process it started."""


class StopSignals:
    """The demo's own SIGINT and SIGTERM handlers, in place while it runs (main thread only).

    Not Python's KeyboardInterrupt: a SIGINT ignored when the demo started (nohup, a shell's
    background job) is never turned into one, and a KeyboardInterrupt raised amid the stop would
    cut it short and leave the nodes running. The handler only notes the signal; the demo's loops
    `check` it (every 0.3 s at most) and then stop every process by PID."""

    def __init__(self) -> None:
        self.received: str = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum).name

    def check(self) -> None:
        if self.received:
            raise Interrupted(f"interrupted ({self.received})")


def wait_for_file(path: Path, child_alive: Any, timeout: float) -> str:
    """Contents of `path` once written; UserError if the writer died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if not child_alive():
            raise UserError(f"the process that should write {path} exited early; see its log")
        time.sleep(0.1)
    raise UserError(f"{path} did not appear within {timeout:.0f} s")


class _Demo:
    def __init__(
        self,
        work_dir: Path,
        nodes: int,
        *,
        steps: int,
        kill_at: int,
        freeze: bool,
        timeout: float,
        quiet: bool,
        place: Placement,
        settings: Sequence[str] = (),
        signals: StopSignals | None = None,
    ):
        self.signals = signals or StopSignals()
        """Where a SIGINT or SIGTERM is noted (checked while starting and following the run)."""
        self.settings = [flag for setting in settings for flag in ("--set", setting)]
        """Config overrides for every node (`--set KEY=VALUE`)."""
        config = _node_config(settings)
        self.inner_steps = config.train.inner_steps
        """H: the run lasts `steps` outer steps of it (train.max_steps follows it)."""
        self.robust = config.comm.robust
        self.sparse = config.comm.codec == "sparse"
        """The aggregation rule the nodes take: an open run's default unless the overrides set one."""
        self.open_run = not config.run.authority
        self.work_dir = work_dir.resolve()
        self.place = place
        self.logs = self.work_dir / "logs"
        self.nodes = nodes
        self.steps = steps
        self.kill_at = kill_at
        self.fault = signal.SIGSTOP if freeze else signal.SIGKILL
        self.timeout = timeout
        self.quiet = quiet
        self.children = ChildProcesses()
        self.names = [f"node{index}" for index in range(nodes)]
        self.victim = self.names[-1] if nodes > 1 and 0 < kill_at < steps else None
        self.joiner = f"node{nodes}" if self.victim else None
        self.started = time.monotonic()
        self.peer = ""
        self.killed_at: float | None = None
        """Wall-clock time of the SIGKILL (metrics files carry wall-clock times too)."""
        self.lines: list[dict[str, Any]] = []
        """The outer-step records the per-step lines printed, with the node each came from: the
        summary reports these very losses."""
        self.bar: Progress | None = None
        if not quiet and sys.stdout.isatty():
            self.bar = Progress(
                TextColumn("outer steps"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self.task = self.bar.add_task("steps", total=steps)
            self.bar.start()

    def say(self, message: str) -> None:
        line = f"[demo {time.monotonic() - self.started:5.1f} s] {message}"
        if self.bar is not None:
            self.bar.console.print(line, highlight=False, markup=False)
        elif not self.quiet:
            print(line, flush=True)

    def stop_bar(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def _fresh(self) -> None:
        """Every demo starts afresh: no checkpoints, metrics or logs of an earlier one."""
        for name in [*self.names, f"node{self.nodes}", "logs"]:
            for sub in ("checkpoints", "metrics.jsonl", "logs"):
                target = self.work_dir / name / sub
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
        shutil.rmtree(self.logs, ignore_errors=True)

    def start(self) -> None:
        self._fresh()
        address_file = self.work_dir / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        self.say("starting the bootstrap peer")
        host = self.place("bootstrap")
        boot = self.children.spawn(
            "bootstrap",
            [
                *host.prefix,
                *p2ptrain_command(
                    "bootstrap",
                    "--listen",
                    host.listen,
                    "--identity",
                    str(self.work_dir / "bootstrap"),
                    "--address-file",
                    str(address_file),
                ),
            ],
            log_path=self.logs / "bootstrap.log",
        )
        self.peer = wait_for_file(address_file, lambda: self.alive(boot), self.timeout).split()[0]
        self.say(f"bootstrap peer up at {self.peer}")
        for name in self.names:
            self.signals.check()
            self.start_node(name, "--set", f"swarm.wait_nodes={self.nodes}")
        self.say(
            f"started {self.nodes} nodes: the debug model, {self.steps} outer steps of H={self.inner_steps}; "
            + (
                "an open run, so robust aggregation is on (comm.robust: reweighted"
                + ("; under the sparse codec its norm clip only)" if self.sparse else ")")
                if self.robust == "reweighted" and self.open_run
                else f"comm.robust: {self.robust}"
            )
        )

    def start_node(self, name: str, *extra: str) -> None:
        host = self.place(name)
        self.children.spawn(
            name,
            [
                *host.prefix,
                *p2ptrain_command(
                    "join",
                    "--peer",
                    self.peer,
                    "--config",
                    "debug",
                    "--work-dir",
                    str(self.work_dir / name),
                    "--listen",
                    host.listen,
                    "--set",
                    f'node.data_host="{host.ip}"',
                    "--set",
                    f"train.inner_steps={self.inner_steps}",
                    "--set",
                    f"train.max_steps={self.steps * self.inner_steps}",
                    "--set",
                    "swarm.straggler_deadline=5",
                    *self.settings,
                    *extra,
                ),
            ],
            log_path=self.logs / f"{name}.log",
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # several nodes share this machine's cores
        )

    def alive(self, child: Any) -> bool:
        """Whether `child` still runs; Interrupted once a signal came (wait_for_file polls it)."""
        self.signals.check()
        return bool(child.poll() is None)

    def release_ram(self) -> None:
        """Flush what SIGKILLed nodes left in /dev/shm (staged checkpoints, the shared vector) to disk."""
        from p2ptrain.ckpt.format import checkpoint_places
        from p2ptrain.config import load_config
        from p2ptrain.identity import load_or_create_identity
        from p2ptrain.node.checkpoint_copies import flush_leftovers
        from p2ptrain.node.rank_launcher import remove_stale_buffers

        for name in [*self.names, *([self.joiner] if self.joiner else [])]:
            work = self.work_dir / name
            if not (work / "node.key").exists():
                continue
            identity = load_or_create_identity(work)
            config = load_config("debug", overrides=[f"node.work_dir={json.dumps(str(work))}"])
            flush_leftovers(checkpoint_places(config, identity.short_id, work), config.checkpoint.keep)
            remove_stale_buffers(identity, work)

    def _final_digest(self, name: str) -> str | None:
        """The shared-state digest (θ_outer, momentum) of `name`'s newest checkpoint on disk."""
        folder = latest_checkpoint(self.work_dir / name / "checkpoints")
        manifest = folder / MANIFEST_FILE if folder is not None else None
        if manifest is None or not manifest.is_file():
            return None
        digest = json.loads(manifest.read_text()).get("digest")
        return digest if isinstance(digest, str) else None

    def outer(self, name: str) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.work_dir / name / "metrics.jsonl") if r["kind"] == "outer"]

    def running(self) -> list[str]:
        return [name for name, child in self.children.children.items() if child.poll() is None]

    def check_children(self) -> None:
        for name, child in self.children.children.items():
            if name != self.victim and child.poll() not in (None, 0):
                raise UserError(f"{name} failed (exit code {child.returncode}); see {self.logs}/{name}.log")

    def follow(self) -> None:
        """Report each outer step as the first node finishes it; kill and replace a node on the way."""
        reported = 0
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.signals.check()
            self.check_children()
            lead_name, lead = max(((name, self.outer(name)) for name in self.names), key=lambda n: len(n[1]))
            for record in lead[reported:]:
                self.lines.append({**record, "node": lead_name})
                ring = " → ".join(record.get("ring", []))
                self.say(
                    f"outer step {record['step']}: loss {record['loss']:.3f}, {record['members']} members "
                    f"({ring}), all-reduce {record.get('sync_s', 0):.2f} s, "
                    f"{record.get('bytes_sent', 0) / 1e6:.2f} MB sent"
                )
            reported = len(lead)
            if self.bar is not None:
                self.bar.update(self.task, completed=reported)
            if (
                self.victim
                and self.joiner
                and reported >= self.kill_at
                and self.joiner not in self.children.children
            ):
                how = signal.Signals(self.fault).name
                self.say(f"{how} {self.victim}; starting {self.joiner}, which recovers from its peers")
                self.children.signal(self.victim, self.fault)
                self.killed_at = time.time()
                self.start_node(self.joiner)
            trainers = [n for n in self.running() if n not in ("bootstrap", self.victim)]
            if reported >= self.steps and not trainers:
                self.check_children()  # one may have failed since the check above
                return
            time.sleep(0.3)
        raise UserError(f"the swarm did not finish {self.steps} outer steps within {self.timeout:.0f} s")

    def summary(self) -> dict[str, Any]:
        names = [*self.names, *([self.joiner] if self.joiner else [])]
        records = {name: self.outer(name) for name in names}
        by_step: dict[int, set[str]] = {}
        for name_records in records.values():
            for record in name_records:
                by_step.setdefault(record["step"], set()).add(record["params_hash"])
        # the losses the per-step lines showed (a step taken without inner steps has none: NaN)
        losses = [line["loss"] for line in self.lines if line["loss"] == line["loss"]]
        join_s = None
        if self.joiner and (self.logs / f"{self.joiner}.log").exists():
            found = re.search(r"join_s=([0-9.]+)", (self.logs / f"{self.joiner}.log").read_text())
            join_s = float(found.group(1)) if found else None
        # the joiner caught up when it ended the run on the swarm's final state: as a member of the
        # last steps, or (a slow machine) having replayed them or fetched the final checkpoint
        caught_up = None
        if self.joiner:
            finals = {self._final_digest(name) for name in self.names if name != self.victim} - {None}
            caught_up = self._final_digest(self.joiner) in finals
        return {
            "outer_steps": len(by_step),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "loss_is": LOSS_IS,
            "nodes_max": max((r["members"] for rs in records.values() for r in rs), default=0),
            "join_s": join_s,
            "joiner_caught_up": caught_up,
            "params_hash_agree": bool(by_step) and all(len(hashes) == 1 for hashes in by_step.values()),
            "killed": self.victim,
            "joined": self.joiner,
            "steps": [_step_view(record) for record in self.lines],
            "killed_at": self.killed_at,
            "work_dir": str(self.work_dir),
            "checkpoints": str(self.work_dir / "node0" / "checkpoints"),
            "logs": str(self.logs),
        }


def _node_config(settings: Sequence[str]) -> Config:
    """The config as the nodes will have it: the demo's H unless the overrides set another (read by
    the config loader the nodes use, environment included)."""
    return load_config("debug", overrides=[f"train.inner_steps={INNER_STEPS}", *settings])


LOSS_IS = "the mean loss of a step's inner phase, on the node that finished the step first (its line's)"
"""What the per-step lines' and the summary's losses are (`loss_first`: the first line's, `loss_last`:
the last line's)."""


def _step_view(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": record["step"],
        "loss": record["loss"],
        "node": record["node"],
        "members": record["members"],
        "ring": record.get("ring", []),
        "allreduce_s": record.get("sync_s"),
        "mb_sent": round(record.get("bytes_sent", 0) / 1e6, 3),
    }


def run_demo(
    work_dir: Path,
    nodes: int = 3,
    *,
    steps: int = 12,
    kill_at: int = 4,
    freeze: bool = False,
    timeout: float = 600.0,
    quiet: bool = False,
    place: Placement = lambda name: Host(),
    settings: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the local swarm and return the summary (also printed unless `quiet`); `settings`:
    `KEY=VALUE` config overrides for every node. SIGINT and SIGTERM stop it (StopSignals)."""
    with StopSignals() as signals:
        return _run(
            _Demo(
                work_dir,
                nodes,
                steps=steps,
                kill_at=kill_at,
                freeze=freeze,
                timeout=timeout,
                quiet=quiet,
                place=place,
                settings=settings,
                signals=signals,
            )
        )


def _run(demo: _Demo) -> dict[str, Any]:
    steps = demo.steps
    summary: dict[str, Any] = {}
    problem = ""
    try:
        demo.start()
        demo.follow()
    except (UserError, Interrupted) as exc:
        problem = str(exc)
    except KeyboardInterrupt:  # run from a thread other than the main one: no handlers of its own
        problem = "interrupted"
    finally:
        demo.stop_bar()
        demo.say("stopping every process (SIGTERM, by PID)")
        orphans = demo.children.stop_all()
        demo.release_ram()
    summary = demo.summary()
    summary["orphans"] = len(orphans)
    summary["seconds"] = round(time.monotonic() - demo.started, 1)
    summary["ok"] = (
        not problem
        and summary["outer_steps"] == steps
        and summary["params_hash_agree"]
        and not orphans
        and (demo.joiner is None or summary["joiner_caught_up"])
    )
    if problem:
        summary["error"] = problem
    demo.say(
        f"{'done' if summary['ok'] else 'FAILED' + (': ' + problem if problem else '')}: "
        f"{summary['outer_steps']} outer steps, loss {_loss(summary['loss_first'])} → "
        f"{_loss(summary['loss_last'])} (the first and last steps' lines), "
        f"up to {summary['nodes_max']} members, params identical on every node after every step: "
        f"{summary['params_hash_agree']}, joiner caught up: {summary['joiner_caught_up']} (join_s "
        f"{summary['join_s']}), {len(orphans)} orphans; "
        f"checkpoints in {summary['checkpoints']}, logs in {summary['logs']}"
    )
    return summary


def _loss(value: float | None) -> str:
    """A loss as the per-step lines print it."""
    return "-" if value is None else f"{value:.3f}"

"""The trainer ranks of one node: started torchrun-style by the agent, watched and stopped by PID."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

from p2ptrain.config import Config
from p2ptrain.deadline import within
from p2ptrain.faults import Faults
from p2ptrain.identity import NodeIdentity
from p2ptrain.memory_limits import OUT_OF_MEMORY_EXIT
from p2ptrain.node.rank_memory import RankMemoryWatch
from p2ptrain.procs import free_port, is_alive

RANK_STOP_TIMEOUT = 10.0
GPU_DRIVER_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Where any one exists, torch may see a GPU (NVIDIA, ROCm, WSL); where none does, it sees none."""


def gpu_driver_present() -> bool:
    """False where torch can see no GPU, found without loading torch (3 s of CPU, ~300 MB)."""
    return any(Path(device).exists() for device in GPU_DRIVER_FILES)


def default_nproc() -> int:
    """One rank per visible GPU, else one. torch is loaded only to count GPUs where a GPU driver is
    present: the agent itself computes nothing with torch."""
    if not gpu_driver_present():
        return 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _buffer_folder(work_dir: Path) -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else work_dir


def remove_stale_buffers(identity: NodeIdentity, work_dir: Path) -> None:
    """Remove the shared files that SIGKILLed agents of this node left behind (their PID is gone)."""
    for stale in _buffer_folder(work_dir).glob(f"p2ptrain-{identity.short_id}-*.grad"):
        pid = stale.stem.rpartition("-")[2]
        if pid.isdigit() and not is_alive(int(pid)):
            stale.unlink(missing_ok=True)


def buffer_path(identity: NodeIdentity, work_dir: Path) -> Path:
    """The shared pseudo-gradient file of this agent: RAM-backed /dev/shm where it exists."""
    return _buffer_folder(work_dir) / f"p2ptrain-{identity.short_id}-{os.getpid()}.grad"


class RankGroup:
    """The node's trainer processes, started torchrun-style, watched and stopped by PID."""

    def __init__(
        self,
        config: Config,
        identity: NodeIdentity,
        *,
        work_dir: Path,
        nproc: int,
        shared: Path,
    ):
        self.config = config
        self.identity = identity
        self.work_dir = work_dir
        self.nproc = nproc
        self.shared = shared
        self.procs: list[asyncio.subprocess.Process] = []
        self.memory: list[RankMemoryWatch] = []
        self.micro_batch = 0
        """The micro-batch the ranks chose (their Hello says), for the out-of-memory advice."""
        self.log_dir = work_dir / "logs"

    async def start(self, resume: Path | None = None, skip_first_inner: bool = False) -> socket.socket:
        """Start the ranks (resuming from `resume`); returns the agent's end of rank 0's channel."""
        await asyncio.sleep(Faults.from_env().slow_start)
        self.procs = []
        self.memory = []
        self.log_dir.mkdir(parents=True, exist_ok=True)
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // self.nproc)
        spec = {
            "config": self.config.model_dump(),
            "node_key": self.identity.public_key.hex(),
            "work_dir": str(self.work_dir),
            "buffer_path": str(self.shared),
            "threads": threads,
            "resume": str(resume) if resume else None,
            "skip_first_inner": skip_first_inner,
        }
        spec_path = self.work_dir / "rank-spec.json"
        spec_path.write_text(json.dumps(spec))
        agent_end, rank_end = socket.socketpair()
        port = free_port()
        for rank in range(self.nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "P2PTRAIN_RANK_SPEC": str(spec_path),
                "P2PTRAIN_AGENT_PID": str(os.getpid()),
            }
            pass_fds: tuple[int, ...] = ()
            if rank == 0:
                env["P2PTRAIN_CHANNEL_FD"] = str(rank_end.fileno())
                pass_fds = (rank_end.fileno(),)
            with (self.log_dir / f"rank-{rank}.log").open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "p2ptrain.train.rank",
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=pass_fds,
                    start_new_session=True,  # Ctrl+C reaches the agent only; it stops the ranks
                )
            self.procs.append(proc)
            self.memory.append(RankMemoryWatch.start(proc.pid))
        rank_end.close()
        return agent_end

    def sample_memory(self) -> None:
        """Note each running rank's peak resident memory (the OOM verdict needs it after death)."""
        for watch, proc in zip(self.memory, self.procs, strict=True):
            if proc.returncode is None:
                watch.sample()

    def describe_exit(self, rank: int) -> str:
        code = self.procs[rank].returncode
        path = self.log_dir / f"rank-{rank}.log"
        log_path = f"; log: {path}"
        last_line = _last_line(path)
        if code == OUT_OF_MEMORY_EXIT and last_line:
            return f"trainer {last_line[:500]}{log_path}"
        last = last_line[:200]
        if rank < len(self.memory) and self.memory[rank].killed_for_memory(code):
            return self.memory[rank].killed_line(rank, self.config, self.micro_batch) + log_path
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"trainer rank {rank} {how}" + (f" ({last})" if last else "") + log_path

    async def stop(self, timeout: float = RANK_STOP_TIMEOUT) -> None:
        running = [proc for proc in self.procs if proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in running:
            try:
                await within(proc.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return ""

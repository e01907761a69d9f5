"""The memory this machine, or this process's memory cgroup, has: read by the ranks and the agent.

/proc/meminfo and the memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) say how much a
node may use; /proc/PID/status how much a process holds; the cgroup's `oom_kill` counter whether
the kernel's OOM killer ended one of its processes.
"""

from __future__ import annotations

from pathlib import Path

from p2ptrain.config import Config

GIB = 1 << 30
OUT_OF_MEMORY_EXIT = 3
"""Exit code of a rank that ran out of memory (its last log line says how)."""


def gib(size: int) -> str:
    """A size in GiB (TiB from 1 TiB on)."""
    return f"{size / GIB:.2f} GiB" if size < 1024 * GIB else f"{size / (1024 * GIB):.2f} TiB"


def out_of_memory_advice(config: Config, micro_batch: int) -> str:
    """The setting to lower first."""
    if micro_batch != 1:
        was = f"it was {micro_batch}; " if micro_batch else ""
        return f"lower train.micro_batch ({was}`p2ptrain config show --memory` estimates each)"
    if not config.train.activation_checkpointing:
        return "set train.activation_checkpointing = true (micro-batch is 1 already)"
    return "use a smaller model or a machine with more memory (micro-batch 1, activation checkpointing on)"


def ram_available() -> int:
    """MemAvailable, or less where this process's memory cgroup has a lower limit left."""
    meminfo = _kib_fields(Path("/proc/meminfo"))
    available = meminfo.get("MemAvailable", meminfo.get("MemTotal", 0))
    limit = cgroup_memory_limit()
    if limit is not None:
        available = min(available, max(0, limit[0] - limit[1]))
    return available


def ram_total(pid: int | str = "self") -> int:
    """MemTotal, or the process's memory cgroup's limit where that is lower."""
    total = _kib_fields(Path("/proc/meminfo")).get("MemTotal", 0)
    limit = cgroup_memory_limit(pid)
    return min(total, limit[0]) if limit is not None else total


def _kib_fields(path: Path) -> dict[str, int]:
    """`Name:   N kB` lines (/proc/meminfo, /proc/PID/status) as bytes; {} where unreadable."""
    found = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                found[name] = int(fields[0]) * 1024
    except OSError:
        pass
    return found


def cgroup_memory_folder(pid: int | str = "self") -> Path | None:
    """The memory cgroup folder of a process (v2 or v1), where it can be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return _existing(Path("/sys/fs/cgroup"), path)
        if "memory" in controllers.split(","):
            return _existing(Path("/sys/fs/cgroup/memory"), path)
    return None


def _existing(root: Path, path: str) -> Path | None:
    """root/path; inside a container whose cgroup is mounted as the root, the path's tail."""
    parts = [part for part in path.split("/") if part]
    for start in range(len(parts) + 1):
        candidate = root.joinpath(*parts[start:])
        if candidate.is_dir():
            return candidate
    return None


def cgroup_memory_limit(pid: int | str = "self") -> tuple[int, int] | None:
    """(limit, usage) in bytes of the process's memory cgroup, or None where it has no limit. The
    usage leaves out inactive file cache, which the kernel reclaims before it kills anyone."""
    folder = cgroup_memory_folder(pid)
    if folder is None:
        return None
    for limit_name, usage_name, cache_name in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
        if limit is not None and usage is not None:
            if limit >= 1 << 60:
                return None
            return limit, max(0, usage - (_keyed(folder / "memory.stat", cache_name) or 0))
    return None


def _keyed(path: Path, key: str) -> int | None:
    """The number after `key` in a cgroup file of `key value` lines (memory.stat, memory.events)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def cgroup_oom_kills(folder: Path | None) -> int | None:
    """How many processes the kernel's OOM killer has ended in this memory cgroup so far."""
    if folder is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        kills = _keyed(folder / name, "oom_kill")
        if kills is not None:
            return kills
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return 1 << 62
    return int(text) if text.isdigit() else None


def peak_rss(pid: int | str) -> int | None:
    """VmHWM, the process's peak resident memory so far, in bytes (while it runs)."""
    return _kib_fields(Path(f"/proc/{pid}/status")).get("VmHWM")


def current_rss(pid: int | str = "self") -> int | None:
    return _kib_fields(Path(f"/proc/{pid}/status")).get("VmRSS")

"""The canonical layout: every parameter of the model, in one order, in one flat fp32 vector.

A 1-rank volunteer and an 8-rank node shard the model differently, but both describe it with the
same (name, shape) list — the order of `named_parameters()` of the unsharded model, tied weights
once — so their pseudo-gradients are the same vector, element for element, and can be averaged.
`gather` builds that vector from FSDP2 shards; `scatter` writes one back into them.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Entry:
    """One parameter's place in the canonical vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


class CanonicalLayout:
    """The (name, shape, offset) list of a model's parameters: what makes vectors of nodes with
    different local world sizes comparable (see the module docstring)."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.numel = sum(entry.numel for entry in entries)

    @classmethod
    def of(cls, model: nn.Module) -> CanonicalLayout:
        """The layout of `model`, sharded or not (FSDP2 keeps names and global shapes)."""
        entries = []
        offset = 0
        for name, param in model.named_parameters():
            entry = Entry(name, tuple(param.shape), offset)
            entries.append(entry)
            offset += entry.numel
        return cls(entries)

    def digest(self) -> str:
        text = ";".join(f"{entry.name}:{'x'.join(map(str, entry.shape))}" for entry in self.entries)
        return hashlib.sha256(text.encode()).hexdigest()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views into `flat` (no copies), by name."""
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def new_flat(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=torch.float32)

    @torch.no_grad()
    def gather(self, model: nn.Module, out: torch.Tensor | None) -> None:
        """Copy the full parameters into `out` (fp32, CPU) — a collective: every local rank calls it,
        only the one passing a buffer (rank 0) receives."""
        self.gather_tensors(dict(model.named_parameters()), out)

    @torch.no_grad()
    def scatter(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Write `flat` (present on every local rank) into this rank's parameters or shards."""
        self.scatter_tensors(dict(model.named_parameters()), flat)

    @torch.no_grad()
    def gather_tensors(self, tensors: dict[str, torch.Tensor], out: torch.Tensor | None) -> None:
        """`gather` for any tensors shaped and sharded like the parameters (e.g. AdamW's moments)."""
        for entry in self.entries:
            tensor = tensors[entry.name]
            full = tensor.full_tensor() if is_dtensor(tensor) else tensor
            if out is not None:
                out[entry.offset : entry.offset + entry.numel].copy_(full.detach().reshape(-1))

    @torch.no_grad()
    def scatter_tensors(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        for entry in self.entries:
            tensor = tensors[entry.name]
            full = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
            if is_dtensor(tensor):
                from torch.distributed.tensor import distribute_tensor

                # src_data_rank=None: each rank cuts its own shard out of its copy, no communication
                shard = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(full)


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `tensor` is an FSDP shard (a DTensor). Until FSDP has sharded a model its module is
    not even imported (a one-rank node never pays the ~1 s of CPU that importing it costs), and
    then no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class LocalWeights:
    """The model's weights in the two forms the trainer moves between: as this rank holds them (its
    FSDP2 shards, or the whole model on a node of one rank), which the inner steps train, and as
    rank 0's canonical vector `flat`, which the outer step works on.

    `gather` and `load` are collectives over the node's local ranks: every rank calls them, in the
    same order, or the node hangs."""

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None, rank0: bool):
        self.model = model
        self.layout = CanonicalLayout.of(model)
        self.group = group
        """A gloo group over the local ranks (None with one rank)."""
        self.rank0 = rank0
        self.flat = self.layout.new_flat()
        """Rank 0: the weights gathered, or to load. Other ranks: where rank 0's arrive in `load`
        (between a `gather` and a `load` it holds nothing of use there)."""

    def gather(self) -> None:
        """The weights into rank 0's `flat`."""
        self.layout.gather(self.model, self.flat if self.rank0 else None)

    def load(self) -> None:
        """Rank 0's `flat` into every rank's weights."""
        broadcast_flat(self.flat, self.group)
        self.layout.scatter(self.model, self.flat)


def broadcast_flat(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Send rank 0's `flat` to every local rank (no-op without a process group)."""
    if group is not None:
        dist.broadcast(flat, src=0, group=group)


def rank0_decides(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Rank 0's `flag` on every local rank, so that they all take the same branch at one step."""
    if group is None:
        return flag
    box = torch.tensor([float(flag)])
    dist.broadcast(box, src=0, group=group)
    return bool(box.item())

"""Process topology: how many processes share the data, and which one this is.

The data topology is read, in order of precedence, from an explicit argument, an initialised
``torch.distributed`` process group, the launcher's environment (``WORLD_SIZE`` / ``RANK`` /
``LOCAL_RANK``) and finally a single process.  A ``DeviceMesh`` narrows the *data* topology to
its data-parallel dimensions: ranks that differ only along ``tp`` / ``cp`` get identical data.

Example::

    >>> topo = ProcessTopology.current()
    >>> topo.num_processes, topo.process_index
    (1, 0)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardplug.core._internal.arguments import check_int, is_int

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ProcessTopology", "Readers", "resolve_data_topology", "distributed_is_active"]

_DATA_DIMS = ("dp_replicate", "dp_shard", "dp", "data_parallel")  # torchtitan's names, and Lightning's


def distributed_is_active() -> bool:
    """True when a default ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; unset it or fix the launcher"
        ) from exc


def _default_device(local_index: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass(frozen=True)
class ProcessTopology:
    """World size, rank, local rank and device of this process.

    Args:
        num_processes: total number of processes (``>= 1``).
        process_index: this process's global rank, in ``[0, num_processes)``.
        local_process_index: rank on this node.
        device: the device this process computes on.
    """

    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        check_processes(self.num_processes, self.process_index)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @classmethod
    def current(cls) -> ProcessTopology:
        """Topology of the running job: process group, else environment, else single process."""
        local = _env_int("LOCAL_RANK")
        if distributed_is_active():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world = _env_int("WORLD_SIZE") or 1
            rank = _env_int("RANK") or 0
        local = rank if local is None else local
        return cls(world, rank, local, _default_device(local))


def check_processes(num_processes: Any, process_index: Any) -> None:
    check_int(
        "num_processes",
        num_processes,
        minimum=1,
        fix="(the number of processes sharing the data; leave it None to read it from the job)",
    )
    if not is_int(process_index) or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index!r} is out of range for num_processes={num_processes}: "
            f"it must be an integer in [0, {num_processes}) (leave it None to read it from the job)"
        )


def _mesh_data_topology(mesh: Any) -> tuple[int, int]:
    """(data world size, data index) of this rank in a ``DeviceMesh``."""
    names = tuple(mesh.mesh_dim_names or ())
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("torch_device_mesh does not contain this rank; pass the mesh this process belongs to")
    if names:
        data_dims = [k for k, name in enumerate(names) if name in _DATA_DIMS]
    else:  # an unnamed mesh is all data parallel
        data_dims = list(range(len(coordinate)))
    if not data_dims:
        return 1, 0  # pure tensor / context parallel: every rank sees the same data
    sizes = [mesh.size(k) for k in data_dims]
    index = 0
    for k, size in zip(data_dims, sizes):
        index = index * size + coordinate[k]
    return math.prod(sizes), index


def resolve_data_topology(
    num_processes: int | None = None,
    process_index: int | None = None,
    torch_device_mesh: Any = None,
) -> tuple[int, int]:
    """Return ``(num_processes, process_index)`` for data sharding.

    Explicit values win; missing ones come from ``torch_device_mesh`` (data-parallel dims only),
    else from :meth:`ProcessTopology.current`.
    """
    if num_processes is None or process_index is None:
        if torch_device_mesh is not None:
            world, rank = _mesh_data_topology(torch_device_mesh)
        else:
            topo = ProcessTopology.current()
            world, rank = topo.num_processes, topo.process_index
        num_processes = world if num_processes is None else num_processes
        process_index = rank if process_index is None else process_index
    check_processes(num_processes, process_index)
    return num_processes, process_index


@dataclass(frozen=True)
class Readers:
    """The ranks that read one loader's data, which must all see the same stream: its
    ``num_processes`` data processes and the ranks that share a data index with one of them (a
    ``DeviceMesh``'s ``tp`` / ``cp`` ranks). ``size``: how many are known to read it (1: no other,
    or not known which: nothing to compare with); ``group``: their process group (``None``: the
    default one).

    Known: every rank of the process group where it has ``num_processes`` ranks, or of
    ``torch_device_mesh`` where the mesh spans the group or is one-dimensional (``mesh["dp"]``: its
    ranks). With other explicit ``num_processes`` or a smaller mesh, which ranks read it is not
    known (a pipeline stage may read no data): comparing with the group could wait forever.

    Example::

        >>> Readers.of(num_processes=1)
        Readers(size=1, group=None)
    """

    size: int = 1
    group: ProcessGroup | None = None

    @classmethod
    def of(cls, num_processes: int, torch_device_mesh: Any = None) -> Readers:
        world = dist.get_world_size() if distributed_is_active() else 1
        if world == 1:
            return cls()
        if torch_device_mesh is None:
            return cls(world) if num_processes == world else cls()
        if torch_device_mesh.size() == world:
            return cls(world)
        if torch_device_mesh.ndim == 1:
            return cls(torch_device_mesh.size(), torch_device_mesh.get_group())
        return cls()

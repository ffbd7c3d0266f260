"""Where this process stands in a training job: its data-parallel rank and its DataLoader worker.

Both are read from torch only where this process has imported torch already (a process group or a
DataLoader worker needs it); a numpy-only caller never pays torch's import here."""

from __future__ import annotations

import sys


def worker() -> tuple[int, int]:
    """This process's loader worker (id, count): (0, 1) outside a DataLoader worker."""
    torch = sys.modules.get("torch")
    if torch is not None:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            return info.id, info.num_workers
    return 0, 1


def distributed() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed when it is initialised in this process, else None.

    A DataLoader worker started with `spawn` (or `forkserver`) has no process group even when its
    parent has one: there this is None, and the datasets use what their parent saw."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None

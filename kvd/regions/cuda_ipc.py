"""CUDA IPC regions, for GPU KV caches.

The worker exports its cache storage with torch's own IPC reduction (the same
handle ``torch.multiprocessing`` sends), and the daemon opens it in its own
CUDA context. Tested only where a GPU exists (tests marked ``gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.core.errors import InvalidArgument
from kvd.core.requests import CudaIpcSource


def export_storage(tensor: torch.Tensor) -> CudaIpcSource:
    """Describe the CUDA allocation behind ``tensor`` for another process."""
    if not tensor.is_cuda:
        raise InvalidArgument("tensor.device", str(tensor.device), "is not a CUDA device")
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return CudaIpcSource(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


@dataclass
class CudaIpcRegion:
    region_id: str
    size: int
    tensor: torch.Tensor
    storage: torch.UntypedStorage
    kind: str = "cuda_ipc"

    @classmethod
    def open(cls, region_id: str, src: CudaIpcSource, size: int) -> CudaIpcRegion:
        field = f"regions[{region_id}].cuda_ipc"
        if not torch.cuda.is_available():
            raise InvalidArgument(field, "handle", "cannot be opened: this daemon has no CUDA device")
        if src.device < 0 or src.device >= torch.cuda.device_count():
            raise InvalidArgument(f"{field}.device", src.device, f"is not one of {torch.cuda.device_count()} devices")
        if size > src.storage_size_bytes:
            raise InvalidArgument(f"regions[{region_id}].size_bytes", size, f"exceeds the allocation's {src.storage_size_bytes} bytes")
        # Opening a handle needs CUDA's state up: without it the call below
        # segfaults (torch.multiprocessing's own rebuild does the same first).
        torch.cuda.init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                src.device,
                src.handle,
                src.storage_size_bytes,
                src.storage_offset_bytes,
                src.ref_counter_handle,
                src.ref_counter_offset,
                src.event_handle or None,
                src.event_sync_required,
            )
        except Exception as e:  # the driver's message is the useful part
            raise InvalidArgument(field, "handle", f"cannot be opened: {e}") from None
        tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{src.device}")
        tensor.set_(storage, 0, (size,), (1,))
        return cls(region_id, size, tensor, storage)

    def backing_bytes(self) -> int:
        return self.size  # a CUDA allocation does not shrink under its handle

    def removed(self) -> bool:
        return False  # an IPC handle names no file: whether its maker freed it cannot be seen from here

    def creator_gone(self) -> bool:
        return False  # nor whether its maker exited (no lock to watch)

    def close(self) -> None:
        # Dropping the last reference to the opened storage is what tells the
        # engine's process (its IPC ref counter) that we are done with it; a
        # daemon that exits holding it leaves the engine's block in limbo.
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.storage = torch.UntypedStorage(0)

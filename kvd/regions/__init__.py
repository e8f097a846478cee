"""Memory the daemon maps itself: POSIX shared memory for CPU caches, CUDA
IPC handles for GPU caches. Both present the same ``MappedRegion``: a flat
uint8 tensor the relayout code views with strides."""

from kvd.regions.base import MappedRegion, check_intact, map_region, map_regions
from kvd.regions.unmapper import close_later

__all__ = ["MappedRegion", "check_intact", "close_later", "map_region", "map_regions"]

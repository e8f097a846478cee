"""POSIX shared memory regions, for CPU KV caches.

Names are never paths: they must match ``SHM_NAME`` and are opened relative
to a directory fd on /dev/shm with O_NOFOLLOW, so neither ``../`` nor an
absolute path nor a symlink can reach another file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from kvd.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvd.regions.unmapper import unmap_when_unviewed

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
PAGE = mmap.PAGESIZE


# A region kvd.caches creates is named for its creator: its pid and its pid
# namespace (the inode of /proc/self/ns/pid). A daemon in the same namespace
# can then tell the creator died without unlinking (SIGKILL, the OOM killer)
# and remove what it left; in another namespace (a Kubernetes sidecar without
# shareProcessNamespace) the pid means nothing there, and nothing is touched.
OWNED_NAME = re.compile(r"^kvd-(\d+)-n([0-9a-f]+)-[0-9a-f]{12}$")

# Its creator also holds a shared flock on the file for as long as it keeps
# the mapping (the lock lives on the open file description, which the mmap
# object's own descriptor keeps): the kernel lets go of it when the process
# exits, however it exits, and a lock is seen from any pid namespace that
# shares /dev/shm. A daemon that saw the lock held when it mapped the region
# (a creator of this release or later) then knows its creator is gone when
# it can take the lock itself, where the pid in the name says nothing.


def pid_namespace() -> str:
    """This process's pid namespace, as the hex inode kvd's region names carry ("" where unknown)."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:
        return ""


def creator_pid(name: str, namespace: str) -> int | None:
    """The pid that created region ``name``, where it was made in ``namespace``; else None."""
    m = OWNED_NAME.match(name)
    if m is None or not namespace or m.group(2) != namespace:
        return None
    return int(m.group(1))


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it is dead, only not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # /proc unreadable: say alive, never remove what might be used


def unlink_name(name: str) -> bool:
    """Remove ``/dev/shm/name``; False if it was gone already, or cannot be
    removed (another user's in the sticky /dev/shm, a read-only mount:
    logged, never raised, so no cleanup takes a daemon down)."""
    try:
        dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        logging.getLogger("kvd.regions").warning("cannot open %s to remove %s: %s", SHM_DIR, name, e)
        return False
    try:
        os.unlink(check_name(name), dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        logging.getLogger("kvd.regions").warning("cannot remove %s/%s: %s", SHM_DIR, name, e)
        return False
    finally:
        os.close(dir_fd)


def orphans(namespace: str) -> list[str]:
    """Regions in /dev/shm made in ``namespace`` by a process that is gone."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if (pid := creator_pid(n, namespace)) is not None and not pid_alive(pid))


def check_name(name: str, field: str = "shm.name") -> str:
    if not SHM_NAME.match(name) or ".." in name:
        raise InvalidArgument(field, name, "must be a bare name of [A-Za-z0-9_.-] (no '/', no '..')")
    return name


def _open(name: str, flags: int, mode: int = 0o600) -> int:
    dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def prefault(mm: mmap.mmap, *, write: bool) -> None:
    """Fault every page in now: a fresh shm page costs ~10x a warm one on first
    touch (0.4-1.5 GB/s measured), which would otherwise land on the first transfer."""
    advice = getattr(mmap, "MADV_POPULATE_WRITE" if write else "MADV_POPULATE_READ", None)
    if advice is not None:
        try:
            mm.madvise(advice)
            return
        except OSError:
            pass
    view = torch.frombuffer(mm, dtype=torch.uint8)
    if view.numel():
        view[::PAGE].sum()  # a read fault on tmpfs allocates the page


def _reserve(fd: int, name: str, size: int) -> None:
    """Allocate the region's pages now. tmpfs grants any ftruncate and kills
    the process with SIGBUS at the first page past its limit (a container's
    /dev/shm is 64 MiB unless given more); fallocate fails cleanly instead."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        st = os.statvfs(SHM_DIR)
        raise ResourceExhausted(
            f"{SHM_DIR} has no room for a {size / 2**20:.0f} MiB KV cache region ({st.f_bavail * st.f_frsize / 2**20:.0f} MiB free "
            f"of {st.f_blocks * st.f_frsize / 2**20:.0f}); give it more (docker run --shm-size, a Memory emptyDir in Kubernetes)"
        ) from None


def _lock_free(fd: int) -> bool:
    """Whether nobody holds a lock on ``fd``'s file: an exclusive lock is
    taken without waiting and given straight back. False where it cannot
    be taken, or the kernel says anything else (never let go on a guess)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _held_shared(fd: int, tries: int = 5) -> bool:
    """Whether ``fd``'s file is held by a shared lock (its creator's): an
    exclusive try fails and a shared one is granted (given straight back).
    Both failing is another prober's exclusive try, for microseconds: asked
    again a few times, then False (nothing is watched on a guess)."""
    for i in range(tries):
        if _lock_free(fd):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            time.sleep(0.001 * (i + 1))
            continue
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    return False


def _open_checked(name: str, field: str, owner_uid: int | None, flags: int = os.O_RDWR) -> tuple[int, os.stat_result]:
    """A worker's file, opened (read-write by default): a bare name, a regular
    file, and with ``owner_uid`` that user's (a worker names only its own memory)."""
    check_name(name, field)
    try:
        fd = _open(name, flags)
    except FileNotFoundError:
        raise InvalidArgument(field, name, f"does not exist in {SHM_DIR}") from None
    except OSError as e:
        raise InvalidArgument(field, name, f"cannot be opened: {e.strerror}") from None
    return fd, _checked(fd, name, field, owner_uid)


def _checked(fd: int, name: str, field: str, owner_uid: int | None) -> os.stat_result:
    """``fd``'s file as ``_open_checked`` wants it (``fd`` closed if not)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(field, name, "is not a regular shared-memory file")
        if owner_uid is not None and st.st_uid != owner_uid:  # checked on the descriptor opened: no race with a rename
            raise PermissionDenied(f"{field}={name!r} belongs to uid {st.st_uid}, not to the registering worker's uid {owner_uid}: "
                                   "a worker registers only its own memory")
    except BaseException:
        os.close(fd)
        raise
    return st


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _names(name: str, file_id: tuple[int, int]) -> bool | None:
    """Whether ``name`` in /dev/shm still names the file ``file_id`` (False:
    gone, or another file's now); None where it cannot be told."""
    try:
        return _file_id(os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)) == file_id
    except FileNotFoundError:
        return False
    except OSError:
        return None


def _tensor_of(mm: mmap.mmap) -> torch.Tensor:
    """The mapping as bytes, every view of which holds it mapped: numpy's
    frombuffer takes a buffer export of the mmap, which torch's views keep
    (torch.frombuffer takes none, so the mmap could unmap under them)."""
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


_CLOSED = mmap.mmap(-1, PAGE)  # what a closed region holds instead of its mapping
_CLOSED.close()

@dataclass
class ShmRegion:
    region_id: str
    name: str
    size: int
    mm: mmap.mmap
    tensor: torch.Tensor
    owner: bool
    kind: str = "shm"
    file_id: tuple[int, int] = (0, 0)  # the mapped file's (st_dev, st_ino): whether its name still names it
    # A descriptor of the file, kept where its creator held its lock when it was
    # mapped (-1: not held, as by a creator of an earlier release): ``creator_gone``.
    lock_probe: int = -1

    @classmethod
    def create(cls, size: int, name: str | None = None, region_id: str | None = None) -> ShmRegion:
        name = check_name(name or f"kvd-{os.getpid()}-n{pid_namespace() or '0'}-{uuid.uuid4().hex[:12]}")
        if size <= 0:
            raise InvalidArgument("size", size, "must be positive")
        fd = _open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while the mapping's descriptor lives (OWNED_NAME's comment)
            os.ftruncate(fd, size)
            _reserve(fd, name, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            prefault(mm, write=True)
            file_id = _file_id(os.fstat(fd))
        except BaseException:
            with contextlib.suppress(OSError):  # a half-made region holds pages nobody would free
                os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        return cls(region_id or name, name, size, mm, _tensor_of(mm), owner=True, file_id=file_id)

    @classmethod
    def open(cls, region_id: str, name: str, size: int, owner_uid: int | None = None, *, watch: bool = False) -> ShmRegion:
        """Map a worker's region; with ``watch`` (its registration's daemon),
        keep a descriptor to tell when its creator lets go of it, where its
        creator holds it locked (``creator_gone``)."""
        field = f"regions[{region_id}].shm.name"
        fd, st = _open_checked(name, field, owner_uid)
        probe = -1
        try:
            if st.st_size < size:
                raise InvalidArgument(f"regions[{region_id}].size_bytes", size, f"exceeds the shm file's {st.st_size} bytes")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if watch and _held_shared(fd):
                probe, fd = fd, -1
            prefault(mm, write=False)
            return cls(region_id, name, size, mm, _tensor_of(mm), owner=False, file_id=_file_id(st), lock_probe=probe)
        except BaseException:
            if probe >= 0:
                os.close(probe)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def backing_bytes(self) -> int:
        try:
            return self.mm.size()  # fstat of the mapping's own descriptor: the file's size now
        except (ValueError, OSError):  # closed
            return 0

    def removed(self) -> bool:
        """Its file is gone from /dev/shm (or its name now names another):
        whoever made it let it go, and only mappings keep its pages."""
        return _names(self.name, self.file_id) is False  # None: cannot tell, so nothing is let go on a guess

    def watch_creator(self) -> CreatorWatch | None:
        """A watch on its creator that outlives this mapping (None where the lock was not held)."""
        return CreatorWatch(self.name, self.file_id, os.dup(self.lock_probe)) if self.lock_probe >= 0 else None

    def creator_gone(self) -> bool:
        """Whether the process that made it has let it go (exited, or closed
        its mapping): its lock is free. False where it was not held when
        mapped: then only the creator's pid can tell (``creator_pid``)."""
        return self.lock_probe >= 0 and _lock_free(self.lock_probe)

    def close(self) -> None:
        probe, self.lock_probe = self.lock_probe, -1
        if probe >= 0:
            os.close(probe)
        # The mapping ends with its last view, not here: a view still in use (a
        # copy thread landing into an ended registration) then writes to memory
        # nobody reads, where an unmap under it would kill the daemon (SIGSEGV).
        # The region lets go of its tensor and its mmap object, which closes (and
        # unmaps) now if no view is left, else on a background thread once the
        # last view has gone: not on the thread that drops it, which may be the
        # event loop (unmapping costs about 25 ms a GiB).
        self.tensor = torch.empty(0, dtype=torch.uint8)
        mm, self.mm = self.mm, _CLOSED
        try:
            mm.close()
        except BufferError:  # a view holds it
            unmap_when_unviewed(mm)
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        unlink_name(self.name)


@dataclass(frozen=True)
class CreatorWatch:
    """A file its creator holds locked, watched for the creator letting go
    of it (its lock free) through a descriptor of the file's own, which the
    holder closes (``close``)."""

    name: str
    file_id: tuple[int, int]
    fd: int

    @classmethod
    def open(cls, name: str, field: str, owner_uid: int | None = None) -> CreatorWatch:
        """A worker's file that its process holds locked (an alive token),
        opened read-only, not mapped: one kvd made (``OWNED_NAME``), of the
        caller's user, held by a shared lock. OSError where it cannot be
        opened here at all."""
        check_name(name, field)
        if not OWNED_NAME.match(name):
            raise InvalidArgument(field, name, "must name a page kvd.caches.alive_token made (kvd-<pid>-n<pid namespace>-<12 hex digits>)")
        fd = _open(name, os.O_RDONLY)  # OSError: not to be seen from here (another /dev/shm, another user's 0600 file)
        st = _checked(fd, name, field, owner_uid)
        if not _held_shared(fd):
            os.close(fd)
            raise InvalidArgument(field, name, "is not held locked by the worker's process (kvd.caches.alive_token makes one)")
        return cls(name, _file_id(st), fd)

    def let_go(self) -> bool:
        """Its creator's lock is free (whatever its name names now)."""
        return _lock_free(self.fd)

    def dup(self) -> CreatorWatch:
        return CreatorWatch(self.name, self.file_id, os.dup(self.fd))

    def close(self) -> None:
        os.close(self.fd)

    def state(self) -> str:
        """"removed": its name no longer names the file (unlinked, or another's);
        "let go": its creator's lock is free; else "held"."""
        named = _names(self.name, self.file_id)
        if named is False:
            return "removed"
        return "let go" if named and _lock_free(self.fd) else "held"  # None: cannot tell, never let go on a guess

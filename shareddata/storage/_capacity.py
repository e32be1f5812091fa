"""How much shared memory is left, and the error that says it is not enough.

A segment in RAM (a memfd) is bounded by RAM and the memory cgroup, never by the
size of the ``/dev/shm`` mount; a segment in ``storage_dir`` by that file system's
free space (``docs/internals.md#memfd``). Capacity is checked before allocating and
every page is reserved up front, so a full memory is :class:`SharedMemoryFullError`
at once, never a SIGBUS later (``docs/internals.md#sigbus``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from .._text import format_bytes
from ..errors import (
    ArgumentTypeError,
    MissingFileError,
    SharedDataError,
    SharedMemoryFullError,
    TooManyOpenFilesError,
)

__all__ = [
    "FULL_ERRNOS",
    "STORAGE_ENV",
    "available_memory",
    "check_capacity",
    "descriptor_error",
    "fallocate",
    "full_error",
    "mapping_error",
    "named_os_errors",
    "resolve_storage_dir",
]

FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
STORAGE_ENV = "SHAREDDATA_STORAGE_DIR"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_FILES = {  # controllers field of /proc/self/cgroup -> (mount, limit file, usage file)
    "v2": ("", "memory.max", "memory.current"),
    "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
}


def _cgroup_available() -> int | None:
    """Bytes the memory cgroup of this process can still take, or None if unlimited.

    The process's own cgroup and every cgroup above it count (cgroup v2, and v1 as
    on a host, under Slurm or systemd, where the limit is on the job's cgroup, not
    the root); the tightest one wins. Inside a container the mount's root is the
    container's own cgroup and the path does not exist under it: the walk up finds
    the root.
    """
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        version = "v2" if controllers == "" else "v1"
        if version == "v1" and "memory" not in controllers.split(","):
            continue
        mount, limit_file, usage_file = _CGROUP_FILES[version]
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            base = os.path.join(_CGROUP_ROOT, mount, *parts[:depth])
            limit = _read_int(os.path.join(base, limit_file))
            used = _read_int(os.path.join(base, usage_file))
            if limit is not None and used is not None and limit < (1 << 60):
                free = limit - used + _reclaimable(os.path.join(base, "memory.stat"))
                best = free if best is None else min(best, free)
    return best


def _reclaimable(stat_path: str) -> int:
    """Inactive page cache in a cgroup: the kernel drops it before failing an allocation."""
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(value)
    except OSError:
        pass
    return 0


def available_memory(storage_dir: str | os.PathLike[str] | None = None) -> int:
    """Bytes that a new segment can take without running the machine out of room.

    Args:
        storage_dir: ``None`` for RAM (memfd): the smaller of ``MemAvailable`` and
            what the memory cgroup still allows; a directory: its free disk space.

    Returns:
        The number of bytes.

    Example:
        >>> available_memory() > 0
        True
    """
    if storage_dir is not None:
        st = os.statvfs(storage_dir)
        return st.f_bavail * st.f_frsize
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = psutil.virtual_memory().available
    cgroup = _cgroup_available()
    return avail if cgroup is None else min(avail, cgroup)


def full_error(needed: int, free: int, storage_dir: str | None, what: str) -> SharedMemoryFullError:
    """The error for ``needed`` bytes that do not fit in ``free``: sizes, place and fixes.

    Example:
        >>> print(full_error(3 << 30, 1 << 30, "/scratch", "x.npy"))  # doctest: +ELLIPSIS
        x.npy needs 3.0 GiB ... free in the file system of storage_dir='/scratch'...
    """
    where = f"the file system of storage_dir={storage_dir!r}" if storage_dir else "RAM"
    fixes = (
        "free disk space or choose another storage_dir"
        if storage_dir
        else "load fewer columns; raise the container's memory limit (Docker `--memory`, "
        "Kubernetes `resources.limits.memory`; a memory-backed `emptyDir` counts against "
        "it too); or put the data in files on a local disk with storage_dir='/path' "
        f"(or the {STORAGE_ENV} environment variable)"
    )
    return SharedMemoryFullError(
        f"{what} needs {format_bytes(needed)} ({needed} bytes) of shared memory but only "
        f"{format_bytes(free)} ({free} bytes) is free in {where}. Nothing was loaded. Fix: {fixes}."
    )


def descriptor_error(error: OSError, what: str) -> TooManyOpenFilesError | None:
    """The named error for ``EMFILE``/``ENFILE`` (no descriptor left); ``None`` for others.

    Every shared segment holds one descriptor in every process that maps it: a process
    that keeps more datasets and arrays alive than ``ulimit -n`` allows gets this
    error, naming the limit and the fix, when it opens the next one.

    Example:
        >>> e = descriptor_error(OSError(errno.EMFILE, "Too many open files"), "a SharedArray")
        >>> e.errno == errno.EMFILE, "ulimit -n" in str(e)
        (True, True)
    """
    if error.errno == errno.ENFILE:
        return TooManyOpenFilesError(
            errno.ENFILE,
            f"cannot open a descriptor for {what}: the system-wide limit of open files "
            "(fs.file-max) is reached. Close files or processes, or raise "
            "`sysctl fs.file-max`.",
        )
    if error.errno != errno.EMFILE:
        return None
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = soft
    higher = hard if hard != resource.RLIM_INFINITY else max(soft * 4, 65536)
    return TooManyOpenFilesError(
        errno.EMFILE,
        f"cannot open a descriptor for {what}: this process holds {held} open files and its "
        f"limit (RLIMIT_NOFILE, `ulimit -n`) is {soft}. Every shareddata dataset and "
        "SharedArray holds one descriptor per shared segment (a SharedDataset one more per "
        "variable-length field) for as long as it lives. Fix: raise the limit before "
        f"starting Python (`ulimit -n {higher}`; the hard limit here is "
        f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}), or in Python "
        f"`resource.setrlimit(resource.RLIMIT_NOFILE, ({higher}, hard))`; or keep fewer "
        "datasets and arrays alive at once (one array of many rows instead of many arrays).",
    )


def mapping_error(error: OSError, size: int, what: str) -> SharedMemoryFullError | None:
    """The named error for ``ENOMEM`` from ``mmap`` (no address space); ``None`` for others.

    Mapping needs address space, not memory: ``ulimit -v`` (``RLIMIT_AS``) counts every
    mapping of the process, shared ones included, and ``vm.max_map_count`` bounds how many
    there are.

    Example:
        >>> e = mapping_error(OSError(errno.ENOMEM, "Cannot allocate memory"), 1 << 30, "x.npy")
        >>> isinstance(e, MemoryError), "ulimit -v" in str(e)
        (True, True)
    """
    if error.errno != errno.ENOMEM:
        return None
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        limit = (
            "unlimited here, so the kernel refused for another reason: too many mappings "
            "(`sysctl vm.max_map_count`) or strict overcommit (`vm.overcommit_memory=2`)"
        )
    else:
        limit = f"{format_bytes(soft)} ({soft} bytes)"
        mapped = _mapped_bytes()
        if mapped is not None:
            limit += f", of which this process maps {format_bytes(mapped)} already"
    return SharedMemoryFullError(
        f"{what} could not be mapped: mapping {format_bytes(size)} ({size} bytes) needs that "
        f"much address space in this process, and the kernel refused it (ENOMEM). The "
        f"address-space limit (RLIMIT_AS, `ulimit -v`) is {limit}; every mapping counts "
        "against it, shared memory and the interpreter's own libraries included. Nothing was "
        "loaded. Fix: raise or remove the limit (`ulimit -v unlimited` before starting "
        "Python), or load less at once (fewer columns, a smaller dataset)."
    )


@contextlib.contextmanager
def named_os_errors(what: str, size: int = 0) -> Iterator[None]:
    """Turn ``EMFILE``/``ENFILE`` inside into :func:`descriptor_error`'s named error.

    With ``size`` (the bytes being mapped), ``ENOMEM`` becomes :func:`mapping_error`'s.

    Example:
        >>> with named_os_errors("a batch"):  # doctest: +ELLIPSIS
        ...     raise OSError(errno.EMFILE, "Too many open files")
        Traceback (most recent call last):
        ...
        shareddata.errors.TooManyOpenFilesError: [Errno 24] cannot open a descriptor for a batch...
    """
    try:
        yield
    except OSError as e:
        if isinstance(e, SharedDataError):
            raise
        named: Exception | None = descriptor_error(e, what)
        if named is None and size:
            named = mapping_error(e, size, what)
        if named is None:
            raise
        raise named from e


def _mapped_bytes() -> int | None:
    """The address space this process maps (``VmSize``), or ``None`` if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_capacity(
    nbytes: int, storage_dir: str | os.PathLike[str] | None = None, what: str = "this allocation"
) -> None:
    """Raise :class:`~shareddata.SharedMemoryFullError` if ``nbytes`` do not fit.

    Args:
        nbytes: bytes about to be allocated.
        storage_dir: where they would go (``None``: RAM).
        what: how to name the allocation in the message (e.g. a file name).

    Raises:
        SharedMemoryFullError: with the bytes needed and free, and the fixes.

    Example:
        >>> check_capacity(1024)
        >>> check_capacity(1 << 62)
        Traceback (most recent call last):
        ...
        shareddata.errors.SharedMemoryFullError: this allocation needs ... is free in RAM...
    """
    free = available_memory(storage_dir)
    if nbytes > free:
        raise full_error(nbytes, free, None if storage_dir is None else str(storage_dir), what)


def resolve_storage_dir(storage_dir: str | os.PathLike[str] | None) -> str | None:
    """The directory for file-backed segments: the argument, ``$SHAREDDATA_STORAGE_DIR``, or None.

    Raises:
        ArgumentTypeError: ``storage_dir`` is not a path.
        MissingFileError: the directory does not exist.

    Example:
        >>> resolve_storage_dir(None) is None or isinstance(resolve_storage_dir(None), str)
        True
    """
    if storage_dir is None:
        storage_dir = os.environ.get(STORAGE_ENV) or None
    if storage_dir is None:
        return None
    if not isinstance(storage_dir, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"storage_dir must be a directory's path (a str or a pathlib.Path) or None for "
            f"RAM, got {type(storage_dir).__name__} {storage_dir!r}"
        )
    path = os.fspath(storage_dir)
    if not os.path.isdir(path):
        raise MissingFileError(
            f"storage_dir={path!r} is not a directory. Create it, or pass storage_dir=None "
            "to keep the data in RAM."
        )
    return path


def fallocate(fd: int, size: int, directory: str | None, what: str) -> bool:
    """Reserve ``size`` bytes of ``fd``; False where the file system cannot.

    Raises:
        SharedMemoryFullError: there is no room for them.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in FULL_ERRNOS:
            raise full_error(size, available_memory(directory), directory, what) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False
    return True

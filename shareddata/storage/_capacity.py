"""How much shared memory is left, and the error that says it is not enough.

A memfd is bounded by RAM and the memory cgroup, never by ``/dev/shm``; a segment in
``storage_dir`` by that file system's free space (``docs/internals.md#memfd``).

Note [A load is refused, never killed]
======================================
Under a memory cgroup a page that does not fit is not an error: the OOM killer
SIGKILLs the process. So a check counts all a load will take before it takes it:
its segments, its :func:`private_peak` (blocks, offsets, read chunks) and a
:func:`margin` (page tables, the kernel, the interpreter, lagging usage figures).
Loads that grow check every growth step. The message names the binding bound: the
cgroup's limit file and usage, or ``MemAvailable``.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
from collections.abc import Callable, Iterator

from .._text import format_bytes
from ..errors import (
    ArgumentTypeError,
    MissingFileError,
    SharedDataError,
    SharedMemoryFullError,
    TooManyOpenFilesError,
)

FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
STORAGE_ENV = "SHAREDDATA_STORAGE_DIR"


def _field(path: str, key: str, scale: int = 1) -> int | None:
    """The number after ``key`` on a line of ``path`` (times ``scale``), or None."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name.rstrip(":") == key:
                    return int(value.split()[0]) * scale
    except (OSError, ValueError, IndexError):
        pass
    return None


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


def _cgroup_room() -> tuple[int, str] | None:
    """Room left in the tightest memory cgroup of this process or above it, described."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
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
                stat = os.path.join(base, "memory.stat")  # inactive cache is reclaimable
                cache = _field(stat, "inactive_file")
                cache = _field(stat, "total_inactive_file") or 0 if cache is None else cache
                if best is None or limit - used + cache < best[0]:
                    text = (
                        f"the memory cgroup {'/' + '/'.join(parts[:depth])} ({limit_file} "
                        f"{format_bytes(limit)}, {format_bytes(used)} in use"
                        + (f", {format_bytes(cache)} of it reclaimable cache)" if cache else ")")
                    )
                    best = (limit - used + cache, text)
    return best


def available_memory(storage_dir: str | os.PathLike[str] | None = None) -> int:
    """Bytes a new segment can take: RAM and cgroup (``None``) or the directory's disk.

    Example:
        >>> available_memory() > 0
        True
    """
    if storage_dir is not None:
        st = os.statvfs(storage_dir)
        return st.f_bavail * st.f_frsize
    return _memory_room()[0]


def _memory_room() -> tuple[int, str]:
    avail = _field("/proc/meminfo", "MemAvailable", 1024)
    if avail is None:
        import psutil

        avail = psutil.virtual_memory().available
    cgroup = _cgroup_room()
    if cgroup is not None and cgroup[0] < avail:
        return cgroup
    return avail, "RAM (MemAvailable)"


_MARGIN_BYTES = 16 << 20
_MARGIN_FRACTION = 64
_PRIVATE: contextvars.ContextVar[tuple[int | Callable[[], int], ...]] = contextvars.ContextVar(
    "shareddata_private", default=()
)


def margin(nbytes: int) -> int:
    """Room left free besides ``nbytes``: 16 MiB + 1/64 (Note [A load is refused, never killed]).

    Example:
        >>> margin(64 << 20) >> 20
        17
    """
    return _MARGIN_BYTES + nbytes // _MARGIN_FRACTION


@contextlib.contextmanager
def private_peak(nbytes: int | Callable[[], int]) -> Iterator[None]:
    """Count ``nbytes`` (or a callable's answer) in every RAM check inside; nesting adds up.

    Example:
        >>> with private_peak(1 << 62):
        ...     check_capacity(1024)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shareddata.errors.SharedMemoryFullError: this allocation needs 1.0 KiB ... privately...
    """
    token = _PRIVATE.set((*_PRIVATE.get(), nbytes))
    try:
        yield
    finally:
        _PRIVATE.reset(token)


def _private() -> int:
    return sum(max(0, int(n() if callable(n) else n)) for n in _PRIVATE.get())


def full_error(
    needed: int, free: int, storage_dir: str | None, what: str, private: int = 0, spare: int = 0
) -> SharedMemoryFullError:
    """The error for ``needed`` bytes (plus ``private`` and ``spare``) not fitting in ``free``.

    Example:
        >>> print(full_error(3 << 30, 1 << 30, "/scratch", "x.npy"))  # doctest: +ELLIPSIS
        x.npy needs 3.0 GiB ... free in the file system of storage_dir='/scratch'...
    """
    where = f"the file system of storage_dir={storage_dir!r}" if storage_dir else None
    where = where or _memory_room()[1]
    fixes = (
        "free disk space or choose another storage_dir"
        if storage_dir
        else "load fewer columns; raise the container's memory limit (Docker `--memory`, "
        "Kubernetes `resources.limits.memory`, Slurm `--mem`; a memory-backed `emptyDir` "
        "counts against it too); or put the data in files on a local disk with "
        f"storage_dir='/path' (or the {STORAGE_ENV} environment variable)"
    )
    extra = ""
    if private or spare:
        total = needed + private + spare
        extra = (
            f", plus {format_bytes(private)} privately while it loads and a margin of "
            f"{format_bytes(spare)} (page tables, the kernel, the interpreter), "
            f"{format_bytes(total)} ({total} bytes) in all,"
        )
    return SharedMemoryFullError(
        f"{what} needs {format_bytes(needed)} ({needed} bytes) of shared memory{extra} but "
        f"only {format_bytes(free)} ({free} bytes) is free in {where}. Nothing was loaded. "
        f"Fix: {fixes}."
    )


def descriptor_error(error: OSError, what: str) -> TooManyOpenFilesError | None:
    """The named error for ``EMFILE``/``ENFILE``; ``None`` for others."""
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
    """The named error for ``ENOMEM`` from ``mmap`` (address space); ``None`` for others."""
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
        mapped = _field("/proc/self/status", "VmSize", 1024)
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
    """``EMFILE``/``ENFILE`` inside, and with ``size`` ``ENOMEM``, raised as named errors.

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


def check_capacity(
    nbytes: int, storage_dir: str | os.PathLike[str] | None = None, what: str = "this allocation"
) -> int:
    """Raise SharedMemoryFullError unless ``nbytes``, the private peak and the margin fit.

    In ``storage_dir`` the private peak and 16 MiB must fit in RAM. Returns what is left.

    Example:
        >>> left = check_capacity(1024)
        >>> check_capacity(1 << 62)
        Traceback (most recent call last):
        ...
        shareddata.errors.SharedMemoryFullError: this allocation needs ... is free in ...
    """
    directory = None if storage_dir is None else str(storage_dir)
    private = _private()
    if directory is not None:
        free = available_memory(directory)
        if nbytes > free:
            raise full_error(nbytes, free, directory, what)
        ram, spare = available_memory(None), margin(0)
        if private + spare > ram:
            raise full_error(0, ram, None, f"{what} (in storage_dir={directory!r})", private, spare)
        return free - nbytes
    spare = margin(nbytes)
    free = available_memory(None)
    if nbytes + private + spare > free:
        raise full_error(nbytes, free, None, what, private, spare)
    return free - nbytes - private - spare


def resolve_storage_dir(storage_dir: str | os.PathLike[str] | None) -> str | None:
    """The argument, ``$SHAREDDATA_STORAGE_DIR``, or None (RAM); checked to be a directory."""
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
    """Reserve ``size`` bytes of ``fd``; False where the file system cannot."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in FULL_ERRNOS:
            raise full_error(size, available_memory(directory), directory, what) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False
    return True

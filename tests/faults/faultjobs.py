"""Functions that scenarios hand to spawned workers (importable, hence picklable)."""

from __future__ import annotations


def check_label(sample):
    """A transform that fails on one sample, as a real data bug would."""
    if int(sample["i"]) == 700:
        raise ValueError("sample 700 has a bad label")
    return sample


def file_system_strategy(worker_id):
    """worker_init_fn: send batches by /dev/shm name instead of one descriptor per tensor."""
    import os

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    segments = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            segments += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shareddata")
        except OSError:
            pass
    print(f"@@WORKER {worker_id} holds {segments} segment descriptors", flush=True)


def try_writes(barrier, report, worker_id):
    """worker_init_fn: worker 0 tries every way to write to the dataset's memory.

    Rows 0-4 of column ``x`` (int64, row i == i): row 0 through the column's numpy
    array (refused), row 1 through a fetched sample (a copy), then forced writes: row 2
    after setting ``flags.writeable``, row 3 through the column's torch view, row 4
    through the raw mapping, and writes what it saw to the file ``report`` (not to
    stdout: a forkserver child's stdout is the one the server started with, which may
    be an earlier test's capture). The sibling worker waits on ``barrier`` until it is done.
    """
    import json

    import numpy as np
    from torch.utils.data import get_worker_info

    ds = get_worker_info().dataset
    shared = ds._columns["x"].arrays["data"]
    if worker_id == 0:
        out = {}
        arr = shared.numpy()
        try:
            arr[0] = -1
            out["numpy"] = "written"
        except ValueError:
            out["numpy"] = "refused"
        sample = ds[1]["x"]
        sample += 100
        out["sample_then"] = int(ds[1]["x"])
        try:
            arr.flags.writeable = True
            arr[2] = -2
            out["flag"] = "written"
        except ValueError:
            out["flag"] = "refused"
        shared.torch()[3] = -3
        raw = shared.segment.view(shared.offset + 4 * 8, 8).view(np.int64)
        raw[0] = -4
        out["own_view"] = shared.numpy()[:5].tolist()
        with open(report, "w") as f:
            json.dump(out, f)
    barrier.wait(timeout=120)


def attack_segments(main_pid, identities, report, worker_id):
    """worker_init_fn: try every way a process of the same user has to change the data.

    ``identities`` are the (device, inode) of the dataset's files. Through this
    worker's own descriptor of each, and through one reopened read-write from
    ``/proc/self/fd`` and from the main process's ``/proc/<main_pid>/fd``: ``pwrite``
    the value 9999 over row 0, map the file shared and writable and write it,
    ``ftruncate`` it to 0 bytes and to twice its size. What each attempt gave (``done``,
    or the errno's name) goes to the JSON file ``report``.
    """
    import errno
    import json
    import mmap
    import os

    wanted = {tuple(i) for i in identities}
    out = {}

    def fds_of(pid):
        found = []
        for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
            try:
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in wanted:
                found.append((name, st.st_size))
        return found

    def attempt(what, action):
        try:
            action()
            out[what] = "done"
        except OSError as e:
            out[what] = errno.errorcode.get(e.errno, str(e.errno))

    def write_shared(fd):
        mapped = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mapped[:8] = (9999).to_bytes(8, "little")
        mapped.close()

    def attack(where, fd, size):
        attempt(f"{where} pwrite", lambda: os.pwrite(fd, (9999).to_bytes(8, "little"), 0))
        attempt(f"{where} mmap shared writable", lambda: write_shared(fd))
        attempt(f"{where} ftruncate 0", lambda: os.ftruncate(fd, 0))
        attempt(f"{where} ftruncate grow", lambda: os.ftruncate(fd, 2 * size))

    own, main = fds_of("self"), fds_of(main_pid)
    out["found"] = [len(own), len(main)]
    for where, pid, found in (("own", "self", own), ("main's", main_pid, main)):
        for name, size in found:
            if pid == "self":
                attack(f"{where} fd", int(name), size)
            try:
                fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR)
            except OSError as e:
                out[f"{where} fd reopened read-write"] = errno.errorcode.get(e.errno, "?")
                continue
            attack(f"{where} fd reopened read-write", fd, size)
            os.close(fd)
    with open(report, "w") as f:
        json.dump(out, f)


def write_and_resize(array, report):
    """Process target: write a SharedArray (numpy and pwrite), then try to resize its file."""
    import errno
    import json
    import os

    out = {}
    array.numpy()[0] = 7
    fd = array.segment.fd
    os.pwrite(fd, (8).to_bytes(8, "little"), 8)
    for what, size in (("ftruncate 0", 0), ("ftruncate grow", 2 * os.fstat(fd).st_size)):
        try:
            os.ftruncate(fd, size)
            out[what] = "done"
        except OSError as e:
            out[what] = errno.errorcode.get(e.errno, str(e.errno))
    with open(report, "w") as f:
        json.dump(out, f)

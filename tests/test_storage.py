import gc
import multiprocessing as mp
import os
import pickle
import time

import numpy as np
import pytest
import torch
from conftest import START_METHODS, fd_links, holders, open_fds, run_isolated

import shareddata as sd
from shareddata.storage import Segment
from shareddata.storage._capacity import available_memory
from shareddata.storage._linux import file_identity
from shareddata.storage._segment import open_sent


def _fill(arr, start, stop, value):
    arr.numpy()[start:stop] = value
    return os.getpid()


def _child_write(arr):
    arr.numpy()[:] = 7


def _child_sum(arr):
    return int(arr.numpy().sum())


def _child_try_write_readonly(arr, q):
    view = arr.numpy()
    try:
        view[0] = 99
        q.put("written")
    except ValueError:
        q.put("refused")
    # Force a write through the raw mapping: it must stay private (copy-on-write).
    raw = arr.segment.view()
    raw[:8] = 255
    q.put(int(raw[0]))


def test_empty_views_are_zero_copy():
    a = sd.SharedArray.empty((4, 3), torch.float32)
    assert a.shape == (4, 3) and a.dtype == np.float32 and a.nbytes == 48 and len(a) == 4
    a.numpy()[1] = 2.0
    assert a.torch()[1].tolist() == [2.0, 2.0, 2.0]
    a.torch()[2] = 5.0
    assert a.numpy()[2].tolist() == [5.0, 5.0, 5.0]
    assert a.numpy().ctypes.data == a.torch().data_ptr()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype=np.int32),
        np.random.default_rng(0).random((5, 2, 3)).astype(np.float16),
        np.array([True, False, True]),
        np.arange(6, dtype=">i4"),
        np.zeros((0, 4), np.uint8),
        torch.arange(12, dtype=torch.int16).reshape(3, 4),
    ],
    ids=["int32", "float16-3d", "bool", "big-endian", "empty", "torch-int16"],
)
def test_from_array_round_trip(array):
    a = sd.SharedArray.from_array(array)
    expected = array.numpy() if isinstance(array, torch.Tensor) else array
    assert a.shape == expected.shape
    assert a.dtype == expected.dtype.newbyteorder("=")
    np.testing.assert_array_equal(a.numpy(), expected)


def test_object_array_refused():
    with pytest.raises(TypeError, match="object array"):
        sd.SharedArray.from_array(np.array([{}, []], dtype=object))


def test_pickle_sends_a_handle_not_the_data():
    small = sd.SharedArray.empty(16, np.uint8)
    big = sd.SharedArray.empty(64 << 20, np.uint8)
    assert len(pickle.dumps(big)) < 300
    assert abs(len(pickle.dumps(big)) - len(pickle.dumps(small))) < 16
    # in the same process a handle maps the same pages
    back = pickle.loads(pickle.dumps(big))
    back.numpy()[123] = 9
    assert big.numpy()[123] == 9


@pytest.mark.parametrize("method", START_METHODS)
def test_process_and_pool_share_writes(method):
    ctx = mp.get_context(method)
    a = sd.SharedArray.empty(1000, np.int64)
    p = ctx.Process(target=_child_write, args=(a,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert (a.numpy() == 7).all()
    with ctx.Pool(2) as pool:
        pids = pool.starmap(_fill, [(a, i * 250, (i + 1) * 250, i) for i in range(4)])
        assert os.getpid() not in pids
        assert pool.apply(_child_sum, (a,)) == 250 * (0 + 1 + 2 + 3)
    np.testing.assert_array_equal(a.numpy(), np.repeat(np.arange(4), 250))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_readonly_array_cannot_change_other_processes(method):
    ctx = mp.get_context(method)
    a = sd.SharedArray.from_array(np.arange(16, dtype=np.uint8))
    ro = a.readonly()
    q = ctx.Queue()
    p = ctx.Process(target=_child_try_write_readonly, args=(ro, q))
    p.start()
    assert q.get(timeout=60) == "refused"
    forced = q.get(timeout=60)
    p.join(60)
    if method == "spawn":  # mapped copy-on-write: the forced write stayed in the child
        assert forced == 255
        np.testing.assert_array_equal(a.numpy(), np.arange(16, dtype=np.uint8))


def test_too_large_raises_before_allocating():
    fds = open_fds()
    free = available_memory()
    with pytest.raises(sd.SharedMemoryFullError) as info:
        sd.SharedArray.empty(free + (1 << 30), np.uint8)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, sd.SharedDataError)
    msg = str(err)
    assert "needs" in msg and "free" in msg and "storage_dir" in msg
    assert open_fds() == fds


def test_the_memory_cgroup_of_this_process_limits_it_not_only_the_root(tmp_path, monkeypatch):
    """A limit on the job's own cgroup (Slurm, systemd; cgroup v1 or v2) counts, the root's too."""
    from shareddata.storage import _capacity

    with open("/proc/self/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    mine = [(c, p) for _, c, p in lines if c == "" or "memory" in c.split(",")]
    if not mine:
        pytest.skip("no memory cgroup here")

    def cgroup(version, path, limit, used):
        mount, limit_file, usage_file = _capacity._CGROUP_FILES[version]
        base = tmp_path.joinpath(mount, *[p for p in path.split("/") if p])
        base.mkdir(parents=True, exist_ok=True)
        (base / limit_file).write_text(f"{limit}\n")
        (base / usage_file).write_text(f"{used}\n")
        (base / "memory.stat").write_text("anon 1\ninactive_file 1000\n")

    for controllers, path in mine:
        version = "v2" if controllers == "" else "v1"
        cgroup(version, "/", "max" if version == "v2" else 9223372036854771712, 6 << 30)
        cgroup(version, path.rstrip("/") + "/job", 64 << 20, 10 << 20)
    monkeypatch.setattr(_capacity, "_CGROUP_ROOT", str(tmp_path))
    proc = tmp_path / "cgroup"  # what /proc/self/cgroup says, one level deeper: the job's
    proc.write_text("".join(f"{i}:{c}:{p.rstrip('/')}/job\n" for i, (c, p) in enumerate(mine)))
    monkeypatch.setattr(_capacity, "_PROC_CGROUP", str(proc))
    assert _capacity._cgroup_room()[0] == (64 << 20) - (10 << 20) + 1000
    assert available_memory() == (64 << 20) - (10 << 20) + 1000
    # the root's limit counts too, when it is the tighter one
    for controllers, _ in mine:
        version = "v2" if controllers == "" else "v1"
        cgroup(version, "/", 32 << 20, 0)
    assert _capacity._cgroup_room()[0] == (32 << 20) + 1000


def test_storage_dir_is_file_backed_and_nameless(tmp_path):
    a = sd.SharedArray.empty(1 << 20, np.uint8, storage_dir=tmp_path)
    a.numpy()[:] = 3
    assert os.listdir(tmp_path) == []  # O_TMPFILE: no name to leave behind
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_child_sum, (a,)) == 3 << 20


def test_storage_dir_env_and_missing_dir(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="storage_dir"):
        sd.SharedArray.empty(10, np.uint8, storage_dir=tmp_path / "nope")
    monkeypatch.setenv("SHAREDDATA_STORAGE_DIR", str(tmp_path))
    a = sd.SharedArray.empty(10, np.uint8)
    assert os.path.realpath(os.readlink(f"/proc/self/fd/{a.segment.fd}")).startswith(
        os.path.realpath(tmp_path)
    )


def test_handle_of_a_freed_array_fails_on_first_use_not_when_unpickled():
    a = sd.SharedArray.empty(10, np.uint8)
    data = pickle.dumps(a)  # a plain pickle: no ticket, the sender must keep the array
    del a
    gc.collect()
    b = pickle.loads(data)  # unpickling never raises (it may run in a pool's thread)
    assert "not attached" in repr(b) and b.shape == (10,) and b.nbytes == 10
    with pytest.raises(sd.AttachError, match="no longer holds it"):
        b.numpy()
    with pytest.raises(sd.AttachError):
        pickle.dumps(b)


def test_a_sent_file_is_opened_only_while_the_sender_holds_it_as_that_descriptor():
    """Closed, its number reused, or past ``ulimit -n``: a named error, nothing left open."""
    import errno
    import fcntl
    import resource

    sent, other, me = os.memfd_create("sent"), os.memfd_create("other"), os.getpid()
    ident, path, why = file_identity(sent), f"/proc/{me}/fd/{sent}", "Keep it open."
    before = open_fds()
    for writable, mode in ((False, os.O_RDONLY), (True, os.O_RDWR)):
        new_fd = open_sent(me, sent, ident, "a probe", why, writable=writable)
        assert file_identity(new_fd) == ident
        assert fcntl.fcntl(new_fd, fcntl.F_GETFL) & os.O_ACCMODE == mode
        os.close(new_fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.dup(0)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # the next open is EMFILE
    try:
        with pytest.raises(sd.TooManyOpenFilesError, match="a probe.*ulimit -n") as info:
            open_sent(me, sent, ident, "a probe", why)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert info.value.errno == errno.EMFILE
    os.dup2(other, sent)  # the number now names another file
    with pytest.raises(sd.AttachError, match="another file") as info:
        open_sent(me, sent, ident, "a probe", why)
    assert path in str(info.value) and why in str(info.value) and open_fds() == before
    os.close(sent)
    with pytest.raises(sd.AttachError, match="no longer holds it") as info:
        open_sent(me, sent, ident, "a probe", why)
    assert path in str(info.value) and why in str(info.value)
    assert isinstance(info.value, OSError) and open_fds() == before - 1
    os.close(other)


def test_a_multiprocessing_pickle_keeps_the_segment_until_it_is_received():
    # Note [Handing a segment over]: ForkingPickler (queues, pools) draws a ticket
    from multiprocessing.reduction import ForkingPickler

    from shareddata.storage._handoff import BOARD

    a = sd.SharedArray.from_array(np.arange(5))
    data, fd = ForkingPickler.dumps(a), a.segment.fd
    held = BOARD.held()  # (earlier tests may have left pickles that nobody received)
    del a
    gc.collect()
    assert BOARD.held() == held + 1 and BOARD.outstanding(fd) == 1  # kept for the receiver
    b = pickle.loads(data)  # the receiver opens it and acknowledges
    assert b.numpy().tolist() == [0, 1, 2, 3, 4]
    deadline = time.monotonic() + 5
    while BOARD.outstanding(fd) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert BOARD.outstanding(fd) == 0


def test_segments_close_their_descriptors():
    fds = open_fds()
    for _ in range(50):
        a = sd.SharedArray.empty(1 << 16, np.uint8)
        a.numpy()[:] = 1
        del a
    gc.collect()
    assert open_fds() == fds
    seg = Segment.create(100)
    seg.close()
    assert open_fds() == fds


def test_a_segment_closes_once_and_refuses_every_use_after():
    from multiprocessing.reduction import ForkingPickler

    fds = open_fds()
    with Segment.create(4096) as segment:
        view = segment.view()
        view[:4] = 9
    assert segment.closed and open_fds() == fds  # its descriptor is gone at once
    assert int(view[0]) == 0  # a leftover view reads zeros, still valid memory
    segment.close()  # idempotent
    uses = [segment.view, segment.handle, segment.seal, segment.__enter__]
    for use in [*uses, lambda: pickle.dumps(segment), lambda: ForkingPickler.dumps(segment)]:
        with pytest.raises(ValueError, match="is closed"):
            use()
    # a receiver with a ticket still gets a segment closed after it was sent
    array = sd.SharedArray.from_array(np.arange(5))
    data = ForkingPickler.dumps(array)
    array.segment.close()
    assert pickle.loads(data).numpy().tolist() == [0, 1, 2, 3, 4]


def test_full_storage_dir_raises_and_small_dev_shm_is_not_a_limit():
    run = run_isolated(
        """
        import os, numpy as np, shareddata as sd
        os.makedirs("/tmp/sd-small", exist_ok=True)
        os.system("mount -t tmpfs -o size=16m tmpfs /tmp/sd-small")
        try:
            sd.SharedArray.empty(32 << 20, np.uint8, storage_dir="/tmp/sd-small")
        except sd.SharedMemoryFullError as e:
            print("FULL", "32.0 MiB" in str(e))
        # RAM segments are memfds: a 64 MiB /dev/shm does not bound them
        a = sd.SharedArray.empty(200 << 20, np.uint8)
        a.numpy()[:] = 1
        print("BIG", int(a.numpy()[::4096].sum()))
        os.system("umount /tmp/sd-small")
        """,
        shm_size="64m",
    )
    assert run.returncode == 0, run.stderr
    if run.isolated:
        assert "FULL True" in run.stdout
    assert f"BIG {(200 << 20) // 4096}" in run.stdout
    assert run.leftovers == []


CHILD_EPOCH = """
import os, time, numpy as np, shareddata as sd
from torch.utils.data import DataLoader
ds = sd.NumpyDataset(np.ones((4096, 1024), np.float32))
st = os.fstat(ds._columns["data"].arrays["data"].segment.fd)
loader = DataLoader(ds, batch_size=64, num_workers=2, multiprocessing_context="spawn")
for i, b in enumerate(loader):
    if i == 2:
        print("RUNNING", st.st_dev, st.st_ino, flush=True)
    time.sleep(0.05)
"""


def test_sigkill_of_the_parent_leaves_nothing():
    run = run_isolated(
        f"""
        import os, signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {CHILD_EPOCH!r}],
                                 stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline().strip()
        dev, ino = map(int, line.split()[1:])
        where = f"/proc/{{child.pid}}/fd"
        fds = [os.stat(os.path.join(where, n)) for n in os.listdir(where)]
        print(line, "HELD", any((st.st_dev, st.st_ino) == (dev, ino) for st in fds), flush=True)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        print("KILLED", flush=True)
        """,
        shm_size="64m",
    )
    assert run.returncode == 0, run.stderr
    running = run.stdout.split("RUNNING", 1)[1].split()
    segment = {(int(running[0]), int(running[1]))}
    assert running[2:4] == ["HELD", "True"], run.stdout  # the right inode was announced
    # orphaned workers notice within ~5 s (DataLoader's watchdog) that the parent is gone;
    # with the last holder the kernel frees the segment
    deadline = time.time() + 20
    while holders(segment) and time.time() < deadline:
        time.sleep(0.2)
    assert not holders(segment), "the segment outlived the killed parent"
    assert run.leftovers == []


def test_ctrl_c_during_a_load_frees_everything(tmp_path):
    np.save(tmp_path / "big.npy", np.ones((1 << 28) // 4, np.float32))  # 256 MiB
    run = run_isolated(
        f"""
        import gc, os, signal, threading, time
        import shareddata as sd
        from shareddata.sources import npy
        shmem = lambda: int(open("/proc/meminfo").read().split("Shmem:")[1].split()[0])
        before = shmem()
        slow = npy._NpyFile.read
        def read(self, out, progress):  # interrupt after the first 64 MiB chunk
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            slow(self, out[: len(out) // 4], progress)
            time.sleep(5)
        npy._NpyFile.read = read
        try:
            sd.NumpyDataset({str(tmp_path / "big.npy")!r})
        except KeyboardInterrupt:
            gc.collect()
            print("INTERRUPTED", shmem() - before)
        """,
        shm_size="64m",
    )
    assert run.returncode == 0, run.stderr
    assert "INTERRUPTED" in run.stdout
    assert int(run.stdout.split()[-1]) < 16 * 1024  # KiB: the 256 MiB segment is gone
    assert run.leftovers == []


def _segment_maps_and_fds() -> tuple[int, int]:
    with open("/proc/self/maps") as f:
        maps = sum("memfd:shareddata" in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shareddata")
        except OSError:
            pass
    return maps, fds


def test_discard_frees_a_segment_whose_arrays_are_still_referenced():
    # what a failed load does while its traceback still holds the buffers
    gc.collect()
    before = _segment_maps_and_fds()
    array = sd.SharedArray.empty((1 << 20,), np.float32)
    view = array.numpy()
    view[:] = 7.0
    assert _segment_maps_and_fds() != before
    array.segment.discard()
    assert _segment_maps_and_fds() == before  # no descriptor, no mapping of the memfd
    assert float(view.max()) == 0.0  # leftover views read zeros instead of crashing
    view[:3] = 1.0  # and stay ordinary private memory
    del array, view
    gc.collect()
    assert _segment_maps_and_fds() == before


def test_only_the_creator_may_discard():
    array = sd.SharedArray.from_array(np.arange(4))
    again = pickle.loads(pickle.dumps(array.readonly()))  # same process: same segment
    assert again.segment is array.segment
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_discard_in_child, (array,)) == "RuntimeError"
    assert array.numpy().tolist() == [0, 1, 2, 3]


def _discard_in_child(array: sd.SharedArray) -> str:
    try:
        array.segment.discard()
    except RuntimeError as e:
        return type(e).__name__
    return "discarded"


def test_deepcopy_copies_a_writable_array_and_copy_aliases_it():
    import copy

    a = sd.SharedArray.from_array(np.arange(6, dtype=np.int32).reshape(2, 3))
    deep = copy.deepcopy(a)
    assert isinstance(deep, sd.SharedArray) and deep.segment is not a.segment
    assert deep.shape == a.shape and deep.dtype == a.dtype and deep.writable
    deep.numpy()[0, 0] = 99
    assert a.numpy()[0, 0] == 0, "a write to the deep copy showed in the original"
    assert deep.numpy().tolist() == [[99, 1, 2], [3, 4, 5]]
    again = pickle.loads(pickle.dumps(deep))  # the copy is a SharedArray like any other
    assert again.numpy()[0, 0] == 99
    shallow = copy.copy(a)  # documented: another array over the same memory
    shallow.numpy()[1, 1] = -1
    assert a.numpy()[1, 1] == -1
    nested = copy.deepcopy({"state": a, "same": a})  # the memo keeps one copy per array
    assert nested["state"] is nested["same"] and nested["state"].segment is not a.segment
    # a read-only array (a dataset's column) cannot change: its deep copy is itself
    ro = a.readonly()
    assert copy.deepcopy(ro) is ro


def test_a_segment_holds_one_descriptor():
    """Note [One descriptor per segment]: the mapping holds none (Python's mmap held a
    duplicate: 2 per array, 4 per SharedList), and every view keeps the mapping alive."""

    def segment_fds() -> set[tuple[str, int]]:  # by name and inode, new ones only: an
        # earlier test's segments (held by a ticket) or pipes may close meanwhile
        links = fd_links().items()
        memfds = [fd for fd, link in links if link == "/memfd:shareddata (deleted)"]
        return {(fd, os.stat(f"/proc/self/fd/{fd}").st_ino) for fd in memfds}

    gc.collect()
    fds = segment_fds()
    arrays = [sd.SharedArray.from_array(np.arange(1000) + k) for k in range(20)]
    assert len(segment_fds() - fds) == 20
    names = [sd.SharedList([{"k": k}] * 10, progress=False) for k in range(20)]
    assert len(segment_fds() - fds) == 40
    views = [a.torch()[10:20] for a in arrays]  # the views alone keep the memory
    del arrays, names
    gc.collect()
    assert len(segment_fds() - fds) == 20
    assert [int(v[0]) for v in views] == [10 + k for k in range(20)]
    del views
    gc.collect()
    assert not segment_fds() - fds


_LIMITS_SCRIPT = """
import gc, json, os, resource, sys
import numpy as np
import shareddata as sd

def fds():
    return len(os.listdir("/proc/self/fd"))

out = {}
base = fds()
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (base + 200, hard))
keep = []
try:
    for _ in range(1000):
        keep.append(sd.SharedArray.empty(64, np.uint8))
except Exception as e:
    out["nofile"] = {"made": len(keep), "mro": [c.__name__ for c in type(e).__mro__],
                     "errno": e.errno, "message": str(e)}
del keep
gc.collect()
out["fds_after"] = fds() - base
with open("/proc/self/status") as f:
    mapped = [int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:")][0]
resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.RLIM_INFINITY))
try:
    sd.SharedArray.empty(768 << 20, np.uint8)
except Exception as e:
    out["as"] = {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
gc.collect()
out["fds_after_as"] = fds() - base
small = sd.SharedArray.from_array(np.arange(5))  # still works below the limit
out["small"] = small.numpy().tolist()
print(json.dumps(out))
"""


def test_descriptor_and_address_space_limits_are_named_errors():
    """ulimit -n: TooManyOpenFilesError (an OSError, EMFILE) naming the limit and the fix,
    after one array per descriptor; ulimit -v: SharedMemoryFullError naming RLIMIT_AS (before:
    bare OSError Errno 24 / Errno 12 from mmap). Nothing is left open after either."""
    import errno
    import json
    import subprocess
    import sys

    from conftest import REPO

    run = subprocess.run(
        [sys.executable, "-c", _LIMITS_SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    nofile = out["nofile"]
    assert nofile["mro"][:3] == ["TooManyOpenFilesError", "SharedDataError", "OSError"], nofile
    assert nofile["errno"] == errno.EMFILE
    assert nofile["made"] >= 190, nofile  # one descriptor per array (was 2: 100 arrays)
    assert "ulimit -n" in nofile["message"] and "RLIMIT_NOFILE" in nofile["message"]
    assert "setrlimit" in nofile["message"]
    assert out["fds_after"] == 0
    address = out["as"]
    assert address["mro"][:3] == ["SharedMemoryFullError", "SharedDataError", "MemoryError"]
    assert "ulimit -v" in address["message"] and "RLIMIT_AS" in address["message"]
    assert "768.0 MiB" in address["message"], address["message"]
    assert out["fds_after_as"] == 0
    assert out["small"] == [0, 1, 2, 3, 4]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch's
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32"])
def test_from_array_of_a_dtype_numpy_lacks_is_named_with_the_fix(name):
    """Issue 29: torch's raw ``TypeError: Got unsupported ScalarType`` was what users saw."""
    dtype = getattr(torch, name)
    t = torch.arange(6, dtype=torch.float32).to(dtype)
    with pytest.raises(sd.UnsupportedDtypeError, match=rf"got a torch\.{name} tensor") as info:
        sd.SharedArray.from_array(t)
    assert isinstance(info.value, TypeError) and ".view(t.dtype)" in str(info.value)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]  # the fix given
    back = sd.SharedArray.from_array(t.view(bits)).torch().view(dtype)
    assert back.dtype == dtype and torch.equal(back.view(bits), t.view(bits))

"""Node-level sharing under torchrun, node shards, NodeShardSampler, verify across ranks.

The torchrun tests run real ``torchrun`` jobs (gloo on CPU) with the scripts in
``tests/distributed/scripts/``; the rest run in this process (or in spawned processes)
with the torchrun environment variables set by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch
from conftest import REPO, TORCHRUN_VARS, run_isolated, torchrun_env
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import distributed
from shareddata.columns._columns import ColumnSpec
from shareddata.datasets._load import build
from shareddata.distributed import (
    LocalRankError,
    LocalRankTimeoutError,
    NodeShard,
    ShardingNotSupportedError,
    node_rows,
)

SCRIPTS = os.path.join(REPO, "tests", "distributed", "scripts")
MIB = 1 << 20


# -- helpers --------------------------------------------------------------------------


def torchrun(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=torchrun_env(**env),
    )


def results(stdout: str) -> list:
    """Every ``RESULT {json}`` the ranks printed (two ranks' lines can run together)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(stdout, match.end())[0] for match in re.finditer(r"RESULT ", stdout)]


def stated_wait(message: str) -> float:
    """The seconds an error message says it waited ("... waited 3.0 s ...")."""
    (seconds,) = re.findall(r"waited (\d+(?:\.\d+)?) s", message)
    return float(seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data_256(tmp_path_factory):
    """A 256 MiB .npy file (65536 rows of 1024 float32)."""
    path = tmp_path_factory.mktemp("dist") / "big.npy"
    rng = np.random.default_rng(0)
    np.save(path, rng.standard_normal((65536, 1024), dtype=np.float32))
    return path


@pytest.fixture(scope="module")
def id_folder(tmp_path_factory):
    """A folder dataset whose ``id`` column is the row number (4096 rows)."""
    folder = tmp_path_factory.mktemp("ids")
    np.save(folder / "id.npy", np.arange(4096, dtype=np.int64))
    np.save(folder / "x.npy", np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8))
    return folder


@pytest.fixture
def as_rank(monkeypatch):
    """Pretend to be one local rank of a torchrun job (a fresh job id each test)."""

    def set_rank(local_rank: int, local_world_size: int, node: int = 0, nodes: int = 1):
        for name in list(os.environ):
            if name.startswith(TORCHRUN_VARS):
                monkeypatch.delenv(name)
        values = {
            "LOCAL_RANK": local_rank,
            "LOCAL_WORLD_SIZE": local_world_size,
            "GROUP_RANK": node,
            "GROUP_WORLD_SIZE": nodes,
            "RANK": node * local_world_size + local_rank,
            "WORLD_SIZE": nodes * local_world_size,
            "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex}",
        }
        values["SHAREDDATA_RANK_PID"] = os.getpid()  # this process is the rank
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_rank


# -- real torchrun --------------------------------------------------------------------


@pytest.mark.slow
def test_two_local_ranks_share_one_copy(data_256, tmp_path):
    """torchrun, 2 ranks x 2 spawn workers over 256 MiB: the node holds the data once."""
    run = torchrun(
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(SCRIPTS, "share_node.py"),
        str(data_256),
        str(tmp_path),
        "--compare-process",
        "--hash",
        "--wrap",
    )
    assert run.returncode == 0, run.stderr[-4000:]
    by_rank = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    r0, r1 = by_rank[0], by_rank[1]
    # Every process of the node is in the report: 2 mains and their 2 workers each.
    assert sorted(r0["roles"]) == sorted(
        f"r{r} {role}" for r in (0, 1) for role in ("main", "worker 0", "worker 1")
    )
    assert r0["local_ranks"] == 2 and r0["rank_copies"] == 1
    assert r0["duplication"] <= 1.10, run.stdout
    assert r0["duplication"] == r1["duplication"]  # the node's report, on every rank
    # The same test reads ~2x when every rank loads its own copy: the measure sees copies.
    assert r0["process_duplication"] >= 1.8, run.stdout
    # Rank 1 maps rank 0's segment (same inode), and both read identical, correct data.
    assert r0["segments"] == r1["segments"]
    assert r0["all_equal"] and r1["all_equal"]
    expected = hashlib.sha1(np.load(data_256, mmap_mode="r").tobytes()).hexdigest()
    assert r0["sha1"] == expected
    # SharedDataset(MyDataset()) and SharedList(...) with no code change: local rank 0
    # reads the items, rank 1 attaches calling __getitem__ only for the sample that ranks
    # compare (the fingerprint of the data); one copy per node.
    assert r0["wrap_calls"] >= 8192 and r1["wrap_calls"] == distributed.SAMPLE_ITEMS
    assert r0["wrap_ok"] and r1["wrap_ok"]
    assert r0["dataset_segments"] == r1["dataset_segments"]
    assert r0["list_segments"] == r1["list_segments"]
    # both measured in one loader (32 MiB each): a per-rank copy of either reads >= 1.5
    assert r0["wrap_duplication"] <= 1.10, run.stdout
    assert r0["wrap_duplication"] == r1["wrap_duplication"]
    assert r0["wrap_process_duplication"] >= 1.8, run.stdout  # share="process": 2 copies


@pytest.mark.slow
def test_two_nodes_on_loopback_copy_shard_and_sampler(id_folder):
    """Two torchrun "nodes" on 127.0.0.1: a copy per node, a shard per node, every row once."""
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        os.path.join(SCRIPTS, "two_nodes.py"),
        str(id_folder),
    ]
    env = torchrun_env()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--node_rank={n}", *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for n in (0, 1)
    ]
    outputs = [p.communicate(timeout=240) for p in nodes]
    for p, (_, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-4000:]
    (everyone,) = [r for out, _ in outputs for r in results(out)]
    assert sorted(r["rank"] for r in everyone) == [0, 1, 2, 3]
    by_node = {n: [r for r in everyone if r["node"] == n] for n in (0, 1)}
    for n, ranks in by_node.items():
        # One copy per node: both local ranks map the same segments...
        assert ranks[0]["full_segments"] == ranks[1]["full_segments"]
        assert ranks[0]["shard_segments"] == ranks[1]["shard_segments"]
        assert ranks[0]["wrapped_segments"] == ranks[1]["wrapped_segments"]
        # SharedDataset / SharedList with shard="node": this node's items only
        assert all(r["wrapped_ok"] and r["listed_ok"] for r in ranks)
        # ...and each node holds its own half with shard="node".
        start, stop = node_rows(4096, n, 2)
        assert all(r["node_shard"] == [start, stop, 4096, n, 2] and r["shard_ok"] for r in ranks)
    # ...and the two nodes do not share (two "nodes" on one host: told apart by GROUP_RANK).
    assert by_node[0][0]["full_segments"] != by_node[1][0]["full_segments"]
    assert by_node[0][0]["wrapped_segments"] != by_node[1][0]["wrapped_segments"]
    for epoch in (0, 1):
        seen = sorted(i for r in everyone for i in r["epochs"][epoch])
        assert seen == list(range(4096))  # every row of the whole dataset exactly once
        assert {len(r["epochs"][epoch]) for r in everyone} == {1024}
    assert everyone[0]["epochs"][0] != everyone[0]["epochs"][1]  # set_epoch reshuffles


@pytest.mark.slow
def test_local_rank_0_failing_reaches_the_other_rank(id_folder):
    """Missing file, full memory, a mismatch, an absent rank 0: errors, never a hang."""
    run = torchrun(
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(SCRIPTS, "failures.py"),
        "errors",
        str(id_folder),
        SHAREDDATA_TIMEOUT="3",
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = {(r["scenario"], r["local_rank"]): r for r in results(run.stdout)}
    missing = got["missing", 1]
    assert missing["type"] == "MissingFileError" and "FileNotFoundError" in missing["mro"]
    assert (
        "local rank 0" in missing["message"] and "missing.npy does not exist" in missing["message"]
    )
    assert got["missing", 0]["type"] == "MissingFileError"
    full = got["full", 1]
    assert full["type"] == "SharedMemoryFullError" and "huge.bin needs" in full["message"]
    # Different in-memory data on the two ranks: both refuse, naming the mismatch.
    assert got["mismatch", 1]["type"] == "LocalRankError"
    assert "in-memory data differs" in got["mismatch", 1]["message"]
    assert got["mismatch", 0]["type"] == "LocalRankError"
    # Local rank 0 never builds the dataset: the other rank gives up after the timeout.
    absent = got["absent", 1]
    assert absent["type"] == "LocalRankTimeoutError" and "TimeoutError" in absent["mro"]
    assert 3 <= stated_wait(absent["message"]) <= absent["seconds"] + 0.05  # what it waited


def test_stray_peers_on_both_sockets_cost_the_job_nothing(id_folder, tmp_path):
    """torchrun, 2 ranks: before local rank 1 loads, and again before sd.verify, stray
    peers reach local rank 0's socket (garbage, a 2 GiB length header, a pickle of the
    wrong shape, an early ack, a message sent a byte every 0.5 s; as root, a process of
    uid 65534). Each is hung up on and logged; both ranks load one copy and verify (before:
    the first stray ended rank 0's server and every rank's load failed). In-process
    variants of each stray: test_wire.py."""
    run = torchrun(
        "--standalone", "--nproc_per_node=2", os.path.join(SCRIPTS, "strays.py"),
        str(id_folder / "x.npy"), str(tmp_path), SHAREDDATA_TIMEOUT="60",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["correct"] and r1["correct"] and r0["segments"] == r1["segments"]
    assert r0["local_ranks"] == r1["local_ranks"] == 2 and r0["rank_copies"] == 1
    assert r1["dataset_strays"] == r1["verify_strays"] == [True] * 4  # each hung up on
    logged = "\n".join(r0["warnings"])
    for socket_kind in ("dataset0", "verifybefore0"):
        for reason in (
            "not shareddata's node protocol",
            "announcing a 2147483648-byte 'hi'",
            "a 'hi' of the wrong shape: 'hello'",
            "a message of kind 'ack' where it expected 'hi'",
        ):
            assert re.search(f"-{socket_kind} dropped: .*{re.escape(reason)}", logged), logged
        if os.geteuid() == 0:
            assert re.search(f"-{socket_kind} dropped: .*uid 65534", logged), logged
    if os.geteuid() == 0:
        assert r1["foreign_exit"] == 0  # hung up on at both sockets
    assert r1["warnings"] == []  # local rank 1 saw nothing wrong


def test_ranks_that_select_differently_are_refused(tmp_path):
    """Same file, other columns / column order / files / fill_value: a LocalRankError
    on both ranks (the other rank got local rank 0's columns, silently)."""
    import h5py
    import pyarrow as pa
    import pyarrow.parquet as pq

    with h5py.File(tmp_path / "xy.h5", "w") as f:
        f["x"], f["y"] = np.arange(8.0), np.arange(8) * 10
    pq.write_table(pa.table({"x": np.arange(8.0), "y": np.arange(8) * 10}), tmp_path / "xy.parquet")
    for name, k in (("xy2", 100), ("more", 1000)):
        table = pa.table({"x": np.arange(8.0) + k, "y": np.arange(8) + k})
        pq.write_table(table, tmp_path / f"{name}.parquet")
    pq.write_table(pa.table({"n": pa.array([1, None, 3])}), tmp_path / "nulls.parquet")
    run = torchrun(
        "--standalone", "--nproc_per_node=2", os.path.join(SCRIPTS, "failures.py"), "selection",
        str(tmp_path), SHAREDDATA_TIMEOUT="20",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    got = {(r["scenario"], r["local_rank"]): r for r in results(run.stdout)}
    for scenario in ("hdf5 keys", "parquet columns", "parquet files", "parquet fill", "shard"):
        for rank in (0, 1):
            assert got[scenario, rank]["type"] == "LocalRankError", (scenario, rank, got)
    shard = got["shard", 1]["message"]  # says what differs, not "in-memory data"
    assert "shard='node'" in shard and "in-memory data differs" not in shard, shard
    assert got["same", 0]["type"] is None and got["same", 1]["type"] is None


def test_ranks_that_wrap_different_data_are_refused(tmp_path):
    """SharedDataset / SharedList of one class and length over different data on two local
    ranks: LocalRankError on both (before: rank 1 silently got rank 0's items). Equal
    data is shared, and the attaching rank reads only a sample of the items; a dataset
    that augments at random (from each rank's own random state) still agrees."""
    run = torchrun(
        "--standalone", "--nproc_per_node=2", os.path.join(SCRIPTS, "failures.py"), "wrapped",
        str(tmp_path), SHAREDDATA_TIMEOUT="30",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    got = {(r["scenario"], r["local_rank"]): r for r in results(run.stdout)}
    for scenario in ("shared dataset data", "shared list data"):
        for rank in (0, 1):
            assert got[scenario, rank]["type"] == "LocalRankError", (scenario, rank, got)
        assert "items" in got[scenario, 1]["message"], got[scenario, 1]["message"]
    for scenario in ("shared dataset same", "shared list same", "shared dataset random"):
        for rank in (0, 1):
            assert got[scenario, rank]["type"] is None, (scenario, rank, got[scenario, rank])
    assert got["shared list generator", 1]["type"] is None  # compared by type only
    calls = {rank: got["calls", rank] for rank in (0, 1)}
    assert calls[0]["item"] == calls[1]["item"] == 5
    assert calls[1]["calls"] == distributed.SAMPLE_ITEMS, calls  # a sample, not 64 items
    assert calls[0]["calls"] >= 64 + distributed.SAMPLE_ITEMS, calls  # every item, and the sample
    assert got["noisy item", 0]["value"] == got["noisy item", 1]["value"]


@pytest.mark.slow
def test_local_rank_0_killed_while_loading(id_folder):
    """SIGKILL of local rank 0 mid-load: the other rank fails at once, not after a timeout."""
    run = torchrun(
        "--standalone",
        "--nproc_per_node=2",
        "--monitor-interval=5",  # let the survivor report before the agent stops it
        os.path.join(SCRIPTS, "failures.py"),
        "dies",
        str(id_folder),
        SHAREDDATA_TIMEOUT="60",
    )
    (dies,) = results(run.stdout)
    assert dies["local_rank"] == 1 and dies["type"] == "LocalRankError"
    assert "exited while loading" in dies["message"]  # at once, not after the 60 s timeout


@pytest.mark.slow
def test_sigkill_of_the_whole_job_leaves_nothing(data_256):
    """SIGKILL every process of a running job: /dev/shm stays empty and Shmem comes back."""
    run = run_isolated(
        f"""
        import json, os, subprocess, sys, time
        import psutil

        def shmem():
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("Shmem:"):
                        return int(line.split()[1]) * 1024

        base = shmem()
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", {os.path.join(SCRIPTS, "hold.py")!r}, {str(data_256)!r}],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        ready = 0
        for line in job.stdout:
            ready += line.startswith("READY")
            if ready == 2:
                break
        during = shmem() - base
        root = psutil.Process(job.pid)
        tree = [root, *root.children(recursive=True)]
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=30)
        for _ in range(150):
            after = shmem() - base
            if after < 64 << 20:
                break
            time.sleep(0.2)
        print(json.dumps({{"ready": ready, "processes": len(tree), "alive": len(alive),
                           "during": during, "after": after}}))
        """,
        shm_size="256m",
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    info = json.loads(run.stdout.strip().splitlines()[-1])
    assert info["ready"] == 2 and info["alive"] == 0
    # 1 agent + 2 ranks + 2x(2 workers + resource tracker) at least
    assert info["processes"] >= 7, info
    # Shmem is machine-wide (other processes move it too): "during" is for the message.
    assert info["after"] < 64 * MIB, info  # the 256 MiB are gone with the processes
    if run.isolated:
        assert run.leftovers == []


# -- the same protocol with hand-set torchrun variables (fast) --------------------------


def _rank_process(env: dict[str, str], source: str, queue, rank_0_gone) -> None:
    os.environ.pop("SHAREDDATA_RANK_PID", None)  # as if a launcher had started it
    os.environ.update(env)
    ds = sd.NumpyDataset(source, progress=False)
    ident = sorted(ds.segment_identity())
    if env["LOCAL_RANK"] == "0":
        queue.put(("0", ident, None))
        return  # exits: the others attached before the constructor returned
    rank_0_gone.wait(60)
    queue.put(("1", ident, float(ds[0 : len(ds)]["d"].sum())))  # reads every page


def test_hand_launched_ranks_share_one_segment_which_outlives_rank_0(tmp_path):
    """Two processes with torchrun's variables (no torchrun): one segment; rank 0 may exit."""
    path = tmp_path / "d.npy"
    data = np.arange(1 << 18, dtype=np.float32).reshape(-1, 4)
    np.save(path, data)
    ctx = multiprocessing.get_context("spawn")
    queue, rank_0_gone = ctx.Queue(), ctx.Event()
    run_id = uuid.uuid4().hex
    procs = []
    for r in (0, 1):
        env = {
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": run_id,
        }
        procs.append(ctx.Process(target=_rank_process, args=(env, str(path), queue, rank_0_gone)))
    for p in procs:
        p.start()
    rank, ident_0, _ = queue.get(timeout=120)
    assert rank == "0"
    procs[0].join(timeout=60)
    assert procs[0].exitcode == 0
    rank_0_gone.set()
    rank, ident_1, total = queue.get(timeout=120)
    procs[1].join(timeout=60)
    assert ident_0 == ident_1  # rank 1 mapped rank 0's segment...
    assert total == float(data.astype(np.float64).sum())  # ...and reads it after rank 0 exited


def _group_process(rank: int, init: str, source: str, queue) -> None:
    import torch.distributed as dist

    for name in list(os.environ):
        if name.startswith(TORCHRUN_VARS):
            del os.environ[name]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ds = sd.NumpyDataset(source, progress=False)
        queue.put((rank, sorted(ds.segment_identity()), distributed.node_context()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_initialised_process_group_without_torchrun_shares_too(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.ones((32, 2), np.float32))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_group_process, args=(r, init, str(path), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    answers = dict(
        (rank, (ident, node)) for rank, ident, node in (queue.get(timeout=120) for _ in procs)
    )
    for p in procs:
        p.join(timeout=60)
    assert answers[0][0] == answers[1][0]
    assert [answers[r][1].local_rank for r in (0, 1)] == [0, 1]
    assert answers[0][1].local_world_size == 2 and answers[0][1].num_nodes == 1


def test_another_rank_that_never_comes_times_out(as_rank, monkeypatch):
    monkeypatch.setenv("SHAREDDATA_TIMEOUT", "0.5")
    as_rank(1, 2)
    for local_rank, what in ((1, "for local rank 0 to start"), (0, r"for local rank\(s\) 1 to")):
        as_rank(local_rank, 2)
        start = time.monotonic()
        with pytest.raises(LocalRankTimeoutError, match=what) as error:
            sd.NumpyDataset(np.arange(10))
        # the message states the time it waited: the timeout at least, never more than passed
        assert 0.5 <= stated_wait(str(error.value)) <= time.monotonic() - start + 0.05


def test_verify_across_ranks_times_out_when_called_on_rank_0_only(as_rank, monkeypatch):
    monkeypatch.setenv("SHAREDDATA_TIMEOUT", "0.5")
    as_rank(0, 2)
    ds = sd.NumpyDataset(np.arange(64), share="process")
    loader = DataLoader(ds, batch_size=16)
    with pytest.raises(LocalRankTimeoutError, match="must be called on every local rank"):
        sd.verify(loader, max_duplication=None)
    report = sd.verify(loader, max_duplication=None, across_ranks=False)
    assert report.local_ranks == 1 and [p.role for p in report.processes] == ["main"]


def _child_dataset(queue) -> None:
    ds = sd.NumpyDataset(np.arange(10), progress=False)  # would wait for local rank 0
    queue.put(ds[4]["data"].item())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_children_of_a_rank_load_on_their_own(as_rank, monkeypatch, method):
    """A worker or pool of local rank 1 inherits LOCAL_RANK=1 but must not pose as it."""
    monkeypatch.setenv("SHAREDDATA_TIMEOUT", "30")
    as_rank(1, 2)
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_child_dataset, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == 4  # posing as rank 1, it would raise after 30 s instead
    child.join(timeout=60)


def test_share_process_loads_here_even_under_torchrun(as_rank):
    as_rank(1, 2)  # local rank 1 would otherwise wait for local rank 0
    ds = sd.NumpyDataset(np.arange(10), share="process")
    assert ds[3]["data"].item() == 3


def test_share_and_shard_values_are_checked():
    with pytest.raises(ValueError, match="share must be"):
        sd.NumpyDataset(np.arange(4), share="nodes")
    with pytest.raises(ValueError, match="shard must be"):
        sd.NumpyDataset(np.arange(4), shard="rank")


def test_the_timeout_variable_is_checked(monkeypatch):
    monkeypatch.setenv("SHAREDDATA_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SHAREDDATA_TIMEOUT"):
        distributed.resolve_timeout()
    monkeypatch.setenv("SHAREDDATA_TIMEOUT", "12.5")
    assert distributed.resolve_timeout() == 12.5
    assert distributed.resolve_timeout(2) == 2.0


# -- node shards ----------------------------------------------------------------------


def _sources(tmp_path, array):
    np.save(tmp_path / "c.npy", array)
    np.save(tmp_path / "f.npy", np.asfortranarray(array))
    np.savez_compressed(tmp_path / "z.npz", z=array)
    return {
        "npy": str(tmp_path / "c.npy"),
        "fortran": str(tmp_path / "f.npy"),
        "npz": str(tmp_path / "z.npz"),
        "array": array,
        "tensor": torch.from_numpy(array),
        "mapping": {"m": str(tmp_path / "c.npy"), "n": array},
    }


@pytest.mark.parametrize("kind", ["npy", "fortran", "npz", "array", "tensor", "mapping"])
@pytest.mark.parametrize("node", [0, 1, 2])
def test_shard_node_reads_exactly_the_nodes_rows(tmp_path, as_rank, kind, node):
    array = np.arange(101 * 3, dtype=np.int32).reshape(101, 3)
    source = _sources(tmp_path, array)[kind]
    as_rank(0, 1, node=node, nodes=3)
    ds = sd.NumpyDataset(source, shard="node", progress=False)
    start, stop = node_rows(101, node, 3)
    assert ds.node_shard == NodeShard(start, stop, 101, node, 3)
    assert len(ds) == stop - start
    for name in ds.columns:
        assert np.array_equal(ds[0 : len(ds)][name].numpy(), array[start:stop])


def test_shard_node_outside_torchrun_is_the_whole_dataset():
    ds = sd.NumpyDataset(np.arange(7), shard="node")
    assert ds.node_shard == NodeShard(0, 7, 7, 0, 1) and len(ds) == 7


def test_the_shard_survives_pickling_into_workers(as_rank):
    as_rank(0, 1, node=1, nodes=2)
    ds = sd.NumpyDataset(np.arange(10), shard="node")
    loader = DataLoader(
        ds,
        batch_size=5,
        num_workers=1,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    assert [b["data"].tolist() for b in loader] == [[5, 6, 7, 8, 9]]
    import pickle

    assert pickle.loads(pickle.dumps(ds)).node_shard == ds.node_shard


class _NoRanges:
    label = "rows.bin"

    def specs(self):
        return [ColumnSpec("x", 4, np.dtype(np.float32))]

    def read(self, spec, buffers, progress):
        buffers["data"][:] = 1

    def close(self):
        pass


def test_shard_node_needs_a_source_that_reads_row_ranges():
    with pytest.raises(ShardingNotSupportedError, match="rows.bin") as err:
        build(_NoRanges(), shard="node")
    assert isinstance(err.value, NotImplementedError) and isinstance(err.value, sd.SharedDataError)
    assert build(_NoRanges())["x"].get(0).item() == 1.0


# -- NodeShardSampler -----------------------------------------------------------------


class _Rows:
    """A stand-in dataset: only len() and node_shard matter to the sampler."""

    def __init__(self, n: int, node_shard: NodeShard | None = None) -> None:
        self.n, self.node_shard = n, node_shard

    def __len__(self) -> int:
        return self.n


def _epoch(as_rank, total, nodes, local, sharded, drop_last, epoch=0):
    seen, lengths = [], set()
    for node in range(nodes):
        start, stop = node_rows(total, node, nodes)
        for lr in range(local):
            as_rank(lr, local, node=node, nodes=nodes)
            ds = (
                _Rows(stop - start, NodeShard(start, stop, total, node, nodes))
                if sharded
                else _Rows(total)
            )
            sampler = sd.NodeShardSampler(ds, seed=7, drop_last=drop_last)
            sampler.set_epoch(epoch)
            indices = list(sampler)
            assert len(indices) == len(sampler)
            lengths.add(len(indices))
            offset = start if sharded else 0
            assert all(start <= i + offset < stop for i in indices)  # only this node's rows
            seen += [i + offset for i in indices]
    assert len(lengths) == 1  # every rank of the job takes the same number of steps
    return seen, lengths.pop()


@pytest.mark.parametrize("sharded", [True, False])
def test_sampler_visits_every_row_once_when_it_divides(as_rank, sharded):
    for epoch in (0, 1):
        seen, _ = _epoch(as_rank, 4096, 2, 4, sharded, drop_last=False, epoch=epoch)
        assert sorted(seen) == list(range(4096))


@pytest.mark.parametrize("total,nodes,local", [(1003, 2, 4), (10, 3, 2), (7, 2, 3)])
def test_sampler_pads_or_drops_uneven_splits(as_rank, total, nodes, local):
    seen, per_rank = _epoch(as_rank, total, nodes, local, True, drop_last=False)
    assert set(seen) == set(range(total))  # every row...
    assert per_rank == math.ceil(math.ceil(total / nodes) / local)
    assert len(seen) - total == per_rank * nodes * local - total  # ...plus the padding only
    seen, per_rank = _epoch(as_rank, total, nodes, local, True, drop_last=True)
    assert len(set(seen)) == len(seen)  # no row twice
    assert per_rank == (total // nodes) // local


def test_sampler_order_depends_on_epoch_and_seed_not_on_the_rank(as_rank):
    as_rank(0, 2)
    ds = _Rows(100)
    a = sd.NodeShardSampler(ds, seed=1)
    first = list(a)
    assert list(a) == first  # no implicit reshuffle, like DistributedSampler
    a.set_epoch(1)
    assert list(a) != first
    assert list(sd.NodeShardSampler(ds, shuffle=False)) == list(range(0, 100, 2))


def test_sampler_refuses_a_shard_of_another_node(as_rank):
    as_rank(0, 2, node=1, nodes=2)
    with pytest.raises(ValueError, match="node 0 of 2"):
        sd.NodeShardSampler(_Rows(50, NodeShard(0, 50, 100, 0, 2)))


# -- small pieces ---------------------------------------------------------------------


def test_node_rows_cover_everything_once():
    for total in (0, 1, 5, 100, 101):
        for nodes in (1, 2, 3, 7):
            ranges = [node_rows(total, g, nodes) for g in range(nodes)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_fingerprints_tell_arguments_apart():
    fp = distributed.fingerprint
    assert fp(("NumpyDataset", "/a.npy", None)) == fp(("NumpyDataset", "/a.npy", None))
    assert fp(("NumpyDataset", "/a.npy", None)) != fp(("NumpyDataset", "/b.npy", None))
    assert fp(("NumpyDataset", "/a.npy", ["x"])) != fp(("NumpyDataset", "/a.npy", None))
    a = np.zeros((1000, 3), np.float32)
    b = a.copy()
    b[500, 1] = 1  # one element in the middle
    assert fp(a) == fp(a.copy()) and fp(a) != fp(b)
    assert fp(torch.zeros(3, dtype=torch.bfloat16)) != fp(torch.ones(3, dtype=torch.bfloat16))


def test_a_rank_0_error_keeps_its_type():
    info = distributed.error_info(sd.MissingFileError("x.npy does not exist"))
    error = distributed.rebuild_error(info, "local rank 0 failed: ")
    assert isinstance(error, sd.MissingFileError) and "x.npy does not exist" in str(error)
    info = distributed.error_info(KeyError("k"))
    assert isinstance(distributed.rebuild_error(info, ""), KeyError)

    class Local(Exception):
        pass

    assert isinstance(
        distributed.rebuild_error(distributed.error_info(Local("?")), ""), LocalRankError
    )

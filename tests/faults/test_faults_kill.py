"""Processes killed or interrupted: the data is freed with them, nothing hangs.

Each test runs a scenario in its own /dev/shm (see faultlib) and ends with
``assert_clean``: no process left, no file in /dev/shm or storage_dir, the segments
held by no one, Shmem back near where it started.
"""

from __future__ import annotations

import pytest
from faultlib import run_scenario

MIB = 256  # dataset size of the training scenarios


@pytest.mark.parametrize("where", ["ram", "store"])
def test_sigkill_of_the_parent_during_a_load(where):
    run = run_scenario(
        f"""
        code = r'''
        from shareddata.sources import npy
        import numpy as np, shareddata as sd
        real = npy._copy_rows
        def slow(dest, src, progress):
            def stalled(n):  # the first 64 MiB are in: hold the rest of the load
                announce()
                print("@@LOADING", flush=True)
                time.sleep(120)
            real(dest, src, stalled)
        npy._copy_rows = slow
        sd.NumpyDataset(np.broadcast_to(np.float32(1), ({MIB} * 256, 1024)),
                        storage_dir=STORE if sys.argv[1] == "store" else None)
        '''
        proc = child(code, "{where}", stdout=subprocess.PIPE, text=True)
        wait_line(proc, "@@LOADING")
        print("@@DURING", shmem_kib(), flush=True)
        os.kill(proc.pid, signal.SIGKILL)
        print("@@RC", proc.wait(30))
        """,
        store_size="300m" if where == "store" else None,
    )
    assert run.returncode == 0, run.describe()
    assert run.value("@@RC") == "-9"
    assert run.segment_bytes >= MIB << 20
    run.assert_clean()


def test_sigkill_of_the_whole_process_group_during_an_epoch():
    run = run_scenario(
        f"""
        proc = child(TRAIN, "spawn", 2, {MIB}, "ram", stdout=subprocess.PIPE, text=True)
        wait_line(proc, "@@RUNNING")
        os.killpg(proc.pid, signal.SIGKILL)  # parent, both workers, resource tracker
        print("@@RC", proc.wait(30))
        deadline = time.time() + 10  # the workers are reaped by init
        while any(n.startswith("torch_") for n in os.listdir("/dev/shm")):
            from shareddata.storage._sweep import sweep
            swept = sweep(min_age=0)
            if swept or time.time() > deadline:
                print("@@SWEPT", len(swept), flush=True)
                break
            time.sleep(0.2)
        """
    )
    assert run.returncode == 0, run.describe()
    assert run.value("@@RC") == "-9"
    # a worker killed while torch was creating a batch's /dev/shm name leaves it
    # behind (Note in shareddata/storage/_sweep.py): `shareddata clean` removes it
    print(f"torch names left by the kill and swept: {run.lines('@@SWEPT')}")
    run.assert_clean()
    # multiprocessing's own semaphores (sem.mp-*, 32 B each) die with no one to unlink
    # them when the resource tracker is killed too: reported, not the library's
    print(f"sem.* left by multiprocessing: {len(run.sem_left)}")


def test_sigkill_of_one_worker_reaches_the_user_and_the_data_survives():
    run = run_scenario(
        """
        import numpy as np, shareddata as sd
        from torch.utils.data import DataLoader
        rows = 64 * 256
        ds = sd.NumpyDataset({"x": np.broadcast_to(np.float32(1), (rows, 1024)),
                              "i": np.arange(rows)})
        announce()
        loader = DataLoader(ds, batch_size=256, num_workers=2,
                            multiprocessing_context="forkserver")
        it = iter(loader)
        next(it)
        victim = it._workers[0].pid
        os.kill(victim, signal.SIGKILL)
        t = time.time()
        try:
            for _ in it:
                pass
            print("@@NOERROR")
        except Exception as e:
            print("@@ERROR", victim, time.time() - t, type(e).__name__, json.dumps(str(e)),
                  flush=True)
        del it
        # the data is intact: a new loader (fork workers) reads every row
        again = DataLoader(ds, batch_size=512, num_workers=2, multiprocessing_context="fork")
        print("@@SUM", sum(int(b["i"].sum()) for b in again) == rows * (rows - 1) // 2)
        """
    )
    assert run.returncode == 0, run.describe()
    victim, seconds, kind, message = run.value("@@ERROR").split(" ", 3)
    if kind in ("ConnectionResetError", "EOFError", "AttachError"):
        # the main process was receiving a batch whose descriptors the dead worker still
        # held (torch passes batch tensors as fds through the worker's resource sharer;
        # shareddata's batches are memfds the main process opens through /proc: Note
        # [How a batch leaves a worker]); when that fails before the worker shows as
        # dead, torch's DataLoader re-raises that error instead of naming the worker
        assert kind != "AttachError" or victim in message, message
        pass
    else:
        assert kind == "RuntimeError", (kind, message)
        assert f"DataLoader worker (pid(s) {victim}) exited unexpectedly" in message or (
            f"DataLoader worker (pid {victim}) is killed by signal" in message
        ), message
    assert float(seconds) < 30
    assert run.value("@@SUM") == "True"
    run.assert_clean()


def test_ctrl_c_during_iteration_with_workers():
    run = run_scenario(
        f"""
        proc = child(TRAIN, "fork", 2, {MIB}, "ram", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        wait_line(proc, "@@RUNNING")
        t = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a hang: print every process's stacks, then fail
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            print("@@HUNG", json.dumps(err[-12000:]), flush=True)
            raise SystemExit(1)
        print("@@RC", proc.returncode, time.time() - t)
        print("@@ERR", json.dumps(err[-3000:]))
        """
    )
    assert run.returncode == 0, run.describe()
    rc, seconds = run.value("@@RC").split()
    err = run.value("@@ERR")
    assert "KeyboardInterrupt" in err, err
    assert "Bus error" not in err and "Segmentation" not in err, err
    assert int(rc) != 0 and float(seconds) < 30
    run.assert_clean()


def test_forkserver_workers_of_a_sigkilled_parent_exit_and_free_the_data():
    # torch's worker checks os.getppid(), and a forkserver worker's parent is the fork
    # server, which lives while its children do: shareddata's attach watches the main
    # process instead (Note [Workers of a killed parent] in shareddata/storage/_parent.py)
    run = run_scenario(
        """
        proc = child(TRAIN, "forkserver", 2, 64, "ram", stdout=subprocess.PIPE, text=True)
        wait_line(proc, "@@RUNNING")
        os.kill(proc.pid, signal.SIGKILL)  # the main process alone: workers and server stay
        print("@@RC", proc.wait(30))
        """,
        settle=15,  # the bound: past it, what still runs is reported (@@ALIVE) and killed
    )
    assert run.returncode == 0, run.describe()
    assert run.value("@@RC") == "-9"
    assert not run.alive_after, (
        f"workers (or their fork server) still ran 15 s after their main process was "
        f"killed, holding the data: {run.alive_after}\n{run.describe()}"
    )
    run.assert_clean()  # and no process maps or holds the dataset's memfd

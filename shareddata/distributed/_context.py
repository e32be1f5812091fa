"""Where this process is in a distributed job: node, local rank, job; the coordination timeout."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .. import errors

__all__ = ["TIMEOUT_ENV", "NodeContext", "Shard", "Share", "node_context", "resolve_timeout"]

T = TypeVar("T")
Share = Literal["node", "process"]
Shard = Literal["node"]

TIMEOUT_ENV = "SHAREDDATA_TIMEOUT"
_RANK_PID_ENV = "SHAREDDATA_RANK_PID"
_DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class NodeContext:
    """This process's place in a distributed job.

    torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (``node``),
    ``GROUP_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``; ``job`` is the same for every
    process of one run of one job.
    """

    local_rank: int
    local_world_size: int
    node: int
    num_nodes: int
    rank: int
    world_size: int
    job: str


ALONE = NodeContext(0, 1, 0, 1, 0, 1, "")
"""A process on its own: where it is outside a distributed job."""


def _env_int(name: str) -> int | None:
    return _env(name, int, "an integer")


def _env(name: str, parse: Callable[[str], T], what: str) -> T | None:
    """Environment variable ``name`` parsed, or ``None`` if it is unset or blank."""
    value = os.environ.get(name, "")
    if not value.strip():
        return None
    try:
        return parse(value)
    except ValueError as e:
        raise errors.InvalidArgumentError(
            f"environment variable {name}={value!r} is not {what}"
        ) from e


def _is_rank_process() -> bool:
    """Whether this is the process the launcher started, not a child that inherited its env.

    The rank marks its pid in ``SHAREDDATA_RANK_PID``; its workers and pools inherit it.
    """
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        return False
    owner = os.environ.get(_RANK_PID_ENV)
    if owner is None:
        os.environ[_RANK_PID_ENV] = str(os.getpid())
        return True
    return owner == str(os.getpid())


def _context_from_env() -> NodeContext | None:
    local_rank, local_size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if local_rank is None or local_size is None or not _is_rank_process():
        return None
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    node, nodes = _env_int("GROUP_RANK"), _env_int("GROUP_WORLD_SIZE")
    if node is None:
        node = rank // local_size if rank is not None else 0
    if nodes is None:
        nodes = max(1, world // local_size) if world is not None else 1
    job = "|".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    )
    return NodeContext(
        local_rank=local_rank,
        local_world_size=local_size,
        node=node,
        num_nodes=nodes,
        rank=local_rank if rank is None else rank,
        world_size=local_size * nodes if world is None else world,
        job=job,
    )


def _host_identity() -> str:
    """What processes that can reach each other's /proc and abstract sockets share."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    for ns in ("net", "pid"):
        with contextlib.suppress(OSError):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    return "/".join(parts)


def _context_from_group() -> NodeContext | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _group_context(dist.get_rank(), dist.get_world_size())


@functools.cache
def _group_context(rank: int, world: int) -> NodeContext:
    import torch.distributed as dist

    mine = (_host_identity(), f"{os.getpid()}-{time.time_ns()}")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)  # collective: every rank builds the dataset
    hosts = list(dict.fromkeys(host for host, _ in everyone))
    same = [r for r, (host, _) in enumerate(everyone) if host == mine[0]]
    return NodeContext(
        local_rank=same.index(rank),
        local_world_size=len(same),
        node=hosts.index(mine[0]),
        num_nodes=len(hosts),
        rank=rank,
        world_size=world,
        job=f"group|{everyone[0][1]}",
    )


def node_context() -> NodeContext | None:
    """This process's node and local rank, or ``None`` outside a distributed job.

    From the torchrun environment, else once from an initialised process group (a
    collective: every rank must get here).

    Example:
        >>> ctx = node_context()
        >>> ctx is None or ctx.local_rank < ctx.local_world_size
        True
    """
    return _context_from_env() or _context_from_group()


def resolve_timeout(timeout: float | None = None) -> float:
    """The coordination timeout in seconds: the argument, ``$SHAREDDATA_TIMEOUT``, or 300."""
    if timeout is None:
        timeout = _env(TIMEOUT_ENV, float, "a number of seconds")
        if timeout is None:
            return _DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise errors.ArgumentTypeError(
            f"the timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not timeout > 0:
        raise errors.InvalidArgumentError(
            f"the timeout must be a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


if "LOCAL_RANK" in os.environ:  # mark the rank before it starts any child
    _is_rank_process()

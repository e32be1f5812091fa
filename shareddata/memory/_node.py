"""``verify`` across the local ranks of a node: one measurement of every process at once.

Local rank 0 measures the processes of every local rank at the same moments, over
``distributed.exchange`` (the node socket, bounded waits); see Note [How duplication
is measured] in ``_verify.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..distributed import NodeContext, exchange, node_context, resolve_timeout, socket_name
from ._account import account, judge
from ._dataset import dataset_identity
from ._process import ProcessMemory, Segments, measure_all
from ._report import MemoryReport

_ROUNDS = itertools.count()


class NodeVerify:
    """What ``verify`` needs to measure every process of a node at the same moment.

    Each :meth:`measurer` call is a node-wide barrier at which local rank 0 measures
    the processes of every local rank at once; :meth:`combine` turns the ranks'
    reports into the node's. See Note [How duplication is measured] in ``_verify.py``.
    """

    def __init__(
        self, ctx: NodeContext, segments: Segments = (), timeout: float | None = None
    ) -> None:
        self.ctx = ctx
        self.segments = sorted(segments)
        self.timeout = resolve_timeout(timeout)
        self.number = next(_ROUNDS)
        self.rows: dict[str, list[ProcessMemory]] = {}

    def _name(self, phase: str) -> str:
        return socket_name(self.ctx, f"verify{phase}", self.number)

    def measurer(self, phase: str) -> Callable[[list[tuple[int | None, str]]], list[ProcessMemory]]:
        """A drop-in for ``measure_all`` that measures the whole node at once."""

        def measure(procs: list[tuple[int | None, str]]) -> list[ProcessMemory]:
            def respond(per_rank: list[tuple[list[Any], list[Any]]]) -> list[Any]:
                owner: dict[int, tuple[int, str]] = {}
                flat: list[tuple[int | None, str]] = []
                segments: set[tuple[int, int]] = set()
                for rank, (rank_procs, rank_segments) in enumerate(per_rank):
                    segments |= {(int(d), int(i)) for d, i in rank_segments}
                    for pid, role in rank_procs:
                        if pid is not None:
                            owner[pid] = (rank, role)
                            flat.append((pid, f"r{rank} {role}"))
                rows = measure_all(flat, segments)
                self.rows[phase] = rows
                mine: list[list[ProcessMemory]] = [[] for _ in per_rank]
                for row in rows:
                    rank, role = owner[row.pid]
                    mine[rank].append(replace(row, role=role))
                return mine

            return exchange(  # type: ignore[no-any-return]
                self.ctx,
                self._name(phase),
                (procs, self.segments),
                respond,
                self.timeout,
                "sd.verify()",
            )

        measure.node_wide = True  # type: ignore[attr-defined]
        return measure

    def combine(self, report: MemoryReport, dataset: Any) -> MemoryReport:
        """The node's report from every local rank's (the same report on every rank)."""
        n_workers = sum(1 for p in report.processes if p.role.startswith("worker"))
        info = {
            "baseline": report.baseline_bytes,
            "workers": n_workers,
            "num_workers": report.num_workers,
            "identity": dataset_identity(dataset),
            "dataset_bytes": report.dataset_bytes,
            "batches": report.batches,
            "resolution": report.resolution,
            "shared_bytes": report.shared_bytes,
            "batch_bytes": report.batch_bytes,
            "counted": report.counted_bytes,
            "exact": report.dataset_bytes - report.unresolved_bytes,
            "received": report.received_bytes,
            "buffer_bytes": report.buffer_bytes,
        }

        def respond(infos: list[dict[str, Any]]) -> list[Any]:
            before, after = self.rows["before"], self.rows["after"]
            nbytes = infos[0]["dataset_bytes"]
            identities = [i["identity"] for i in infos]
            copies = len({x for x in identities if x is not None}) + identities.count(None)
            found = account(
                before,
                after,
                sum(i["workers"] * i["baseline"] for i in infos),
                sum(i["resolution"] for i in infos),
                max(nbytes - infos[0]["shared_bytes"], 0),
                sum(i["counted"] for i in infos),
            )
            duplication = copies + found.attributed / nbytes if nbytes > 0 else float(copies)
            verdict = judge(
                dataset_bytes=nbytes,
                exact_bytes=min(i["exact"] for i in infos),
                resolution=found.resolution,
                processes=len(after),
                duplication=duplication,
                limit=report.max_duplication,
                workers_missing=any(i["num_workers"] and not i["workers"] for i in infos),
                found=found,
            )
            node = MemoryReport(
                dataset_bytes=nbytes,
                total_pss=sum(p.pss for p in after),
                duplication=duplication,
                processes=after,
                baseline_bytes=round(sum(i["baseline"] for i in infos) / len(infos)),
                start_method=report.start_method,
                num_workers=sum(i["num_workers"] for i in infos),
                pss_before=sum(p.pss for p in before),
                extra_bytes=round((duplication - 1) * nbytes),
                batches=infos[0]["batches"],
                max_duplication=report.max_duplication,
                local_ranks=len(infos),
                rank_copies=copies,
                shared_bytes=infos[0]["shared_bytes"],
                copied_bytes=found.copies,
                working_bytes=found.excess,
                resolution=found.resolution,
                batch_bytes=max(i["batch_bytes"] for i in infos),
                received_bytes=infos[0]["received"],
                buffer_bytes=infos[0]["buffer_bytes"],
                counted_bytes=sum(i["counted"] for i in infos),
                conclusive=verdict.conclusive,
                unresolved_bytes=verdict.unresolved,
                needed_bytes=verdict.needed,
            )
            return [node] * len(infos)

        return exchange(self.ctx, self._name("combine"), info, respond, self.timeout, "sd.verify()")


def node_verifier(across_ranks: bool | None, segments: Segments = ()) -> NodeVerify | None:
    """The node-wide helper for ``verify``, or ``None`` to measure this process alone."""
    if across_ranks is False:
        return None
    ctx = node_context()
    if ctx is None or ctx.local_world_size <= 1:
        return None
    return NodeVerify(ctx, segments)


# --------------------------------------------------------------------------------------

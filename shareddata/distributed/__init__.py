"""One copy per node under ``torchrun``, node-sharded datasets, and :class:`NodeShardSampler`.

Under ``torchrun`` (or an initialised process group) local rank 0 of each node loads
a dataset and the other local ranks attach to its pages (``share="process"`` opts
out); ``shard="node"`` loads only the node's ``1/num_nodes`` of the rows.
"""

from __future__ import annotations

from ..errors import LocalRankError, LocalRankTimeoutError, ShardingNotSupportedError
from ._context import TIMEOUT_ENV, NodeContext, Shard, Share, node_context, resolve_timeout
from ._fingerprint import SAMPLE_ITEMS, describe, fingerprint, sample_digest
from ._node import error_info, exchange, load_on_node, rebuild_error, socket_name
from ._shard import NodeShard, NodeShardSampler, global_indices, node_rows

__all__ = [
    "SAMPLE_ITEMS",
    "TIMEOUT_ENV",
    "LocalRankError",
    "LocalRankTimeoutError",
    "NodeContext",
    "NodeShard",
    "NodeShardSampler",
    "Shard",
    "Share",
    "ShardingNotSupportedError",
    "describe",
    "error_info",
    "exchange",
    "fingerprint",
    "global_indices",
    "load_on_node",
    "node_context",
    "node_rows",
    "rebuild_error",
    "sample_digest",
    "resolve_timeout",
    "socket_name",
]

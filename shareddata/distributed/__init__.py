"""One copy per node under ``torchrun``, node-sharded datasets, and :class:`NodeShardSampler`.

Every shareddata dataset built under ``torchrun`` (or once ``torch.distributed`` is
initialised) is loaded by local rank 0 of each node; the other local ranks of that
node attach to the same pages, and so do all their DataLoader workers. Nothing is
needed from the user; ``share="process"`` opts out. ``shard="node"`` loads only the
node's contiguous ``1/num_nodes`` of the rows, and :class:`NodeShardSampler` splits
them among the local ranks.
"""

from __future__ import annotations

from ..errors import LocalRankError, LocalRankTimeoutError, ShardingNotSupportedError
from ._context import TIMEOUT_ENV, NodeContext, Shard, Share, node_context, resolve_timeout
from ._fingerprint import SAMPLE_ITEMS, describe, fingerprint, sample_digest
from ._node_load import load_on_node
from ._shard import NodeShard, NodeShardSampler, global_indices, node_rows
from ._wire import error_info, exchange, rebuild_error, socket_name

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

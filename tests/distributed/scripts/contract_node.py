"""Run under torchrun: every local rank builds every dataset kind; record what it maps.

For each kind (``tests/kinds.py``), the rank builds the dataset over the files the
test wrote beforehand (``reuse=True``: nobody writes them here), checks a few rows,
and records the shared-memory files (device, inode) that building it newly mapped in
this process. Ranks that share one copy map the same inodes. Writes
``<out>/rank<RANK>.json`` (files, not stdout: the ranks share one pipe).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kinds import KINDS, assert_item, make  # noqa: E402


def shared_inodes() -> set[str]:
    """The shareddata memfds this process maps (``/memfd:shareddata`` in its maps)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and "memfd:shareddata" in parts[5] and "batch" not in parts[5]:
                found.add(f"{parts[3]}:{parts[4]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--share", default=None)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    result: dict[str, object] = {"rank": int(os.environ["RANK"])}
    keep = []  # every dataset stays alive until all are recorded
    for kind in KINDS:
        before = shared_inodes()
        ds, expected = make(kind, args.data, rows=args.rows, reuse=True, share=args.share)
        for i in (0, args.rows // 2, -1):
            assert_item(ds[i], expected[i], kind)
        result[kind] = sorted(shared_inodes() - before)
        keep.append(ds)
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

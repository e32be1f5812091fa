#!/usr/bin/env bash
# The demo: one synthetic dataset read by DataLoader workers twice, with a plain numpy
# Dataset and with shareddata; it ends with how many times each holds the data, the
# memory saved and the time to the first batch (docs/cli.md shows a transcript).
# Sets up .venv-demo first with the package and its runtime dependencies only
# (scripts/setup.sh demo: 15 packages, 968 MiB, 178 s on the first run on a loaded
# 2-core VM; seconds after).
# Extra arguments go to the demo, e.g.
#   bash scripts/demo.sh --size 1GiB --workers 4
#   bash scripts/demo.sh --plot memory.png   # after .venv-demo/bin/pip install matplotlib
# (`bash scripts/demo.sh --help` lists them).
set -euo pipefail
start=$SECONDS
source "$(dirname "$0")/setup.sh" demo
echo "set-up done in $((SECONDS - start)) s"
echo
start=$SECONDS
python -m shareddata demo "$@"
echo "(the demo took $((SECONDS - start)) s after set-up)"

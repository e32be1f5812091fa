#!/usr/bin/env bash
# Set up .venv from scratch if needed, then run the demo: a synthetic dataset served
# to spawn workers, naive Dataset vs shareddata, memory reports side by side.
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --size 256MiB --workers 2`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
python -m shareddata demo "$@"

#!/usr/bin/env bash
# Set up .venv from scratch if needed, then run the whole test suite (ruff included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k storage -x`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
python -m pytest "$@"

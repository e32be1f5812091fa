#!/usr/bin/env bash
# Set up .venv from scratch if needed, then run the whole test suite (ruff included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k storage -x`.
# `bash scripts/test.sh --quick` runs the quick tier only (tests/conftest.py: the contract
# over every dataset kind with fork workers, sources, ruff; 556 s on a 2-core VM at load
# average ~14, README.md#tests). `bash scripts/test.sh --bench` also runs the opt-in
# tests marked `bench` (the benchmark suite end to end); CI runs neither flag.
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
if [ "${1:-}" = "--quick" ]; then
    shift
    exec python -m pytest --quick tests "$@"
fi
python -m pytest "$@"

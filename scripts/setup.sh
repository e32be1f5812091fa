#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install shareddata with its
# test extras into it. Sourced by scripts/test.sh and scripts/demo.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${SHAREDDATA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r requirements-dev.txt -e '.[dev]'
export PATH="$PWD/$VENV/bin:$PATH"

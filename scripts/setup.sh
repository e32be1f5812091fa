#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install shareddata (editable) into it,
# with the pinned torch (requirements-dev.txt). Sourced, with what to install:
#   source scripts/setup.sh dev    # scripts/test.sh, fuzz.sh: .venv, the whole test set
#   source scripts/setup.sh demo   # scripts/demo.sh: .venv-demo, the package and its
#                                  # runtime dependencies only (torch, numpy, psutil, tqdm)
# SHAREDDATA_VENV names another folder. A new venv shows pip's progress; an existing
# one is brought up to date quietly (seconds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-dev}" in
dev) VENV=${SHAREDDATA_VENV:-.venv} EXTRA='.[dev]' ;;
demo) VENV=${SHAREDDATA_VENV:-.venv-demo} EXTRA='.' ;;
*) echo "scripts/setup.sh: expected dev or demo, got '$1'" >&2 && exit 2 ;;
esac
quiet=--quiet
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV (${PYTHON:-python3} -m venv) ..."
    "${PYTHON:-python3}" -m venv "$VENV"
    quiet=
fi
if [ -n "$quiet" ]; then
    echo "bringing $VENV up to date: pip install --quiet -r requirements-dev.txt -e '$EXTRA'"
else
    echo "installing into $VENV: pip install -r requirements-dev.txt -e '$EXTRA'"
fi
"$VENV/bin/python" -m pip install $quiet --disable-pip-version-check \
    -r requirements-dev.txt -e "$EXTRA"
export PATH="$PWD/$VENV/bin:$PATH"

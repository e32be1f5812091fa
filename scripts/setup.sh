#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install shareddata (editable) into it,
# with the pinned torch (requirements-dev.txt). Sourced, with what to install:
#   source scripts/setup.sh dev    # scripts/test.sh, fuzz.sh: .venv, the whole test set
#   source scripts/setup.sh demo   # scripts/demo.sh: .venv-demo, the package and its
#                                  # runtime dependencies only (torch, numpy, psutil, tqdm)
# SHAREDDATA_VENV names another folder. pip shows its progress; a venv installed from
# the same pyproject.toml and requirements-dev.txt is reused as it is.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-dev}" in
dev) VENV=${SHAREDDATA_VENV:-.venv} EXTRA='.[dev]' ;;
demo) VENV=${SHAREDDATA_VENV:-.venv-demo} EXTRA='.' ;;
*) echo "scripts/setup.sh: expected dev or demo, got '$1'" >&2 && exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV (${PYTHON:-python3} -m venv) ..."
    "${PYTHON:-python3}" -m venv "$VENV"
fi
# what was installed last: the pins and the extra (the package itself is editable)
stamp="$VENV/.shareddata-setup"
want="$(cat pyproject.toml requirements-dev.txt | cksum) $EXTRA"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "$VENV is up to date with pyproject.toml and requirements-dev.txt"
else
    echo "installing into $VENV: pip install -r requirements-dev.txt -e '$EXTRA'"
    rm -f "$stamp"
    "$VENV/bin/python" -m pip install --disable-pip-version-check \
        -r requirements-dev.txt -e "$EXTRA"
    echo "$want" >"$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"

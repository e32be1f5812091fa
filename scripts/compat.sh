#!/usr/bin/env bash
# Run the quick test tier against other torch releases than the pinned one, each in a
# virtual environment of its own (.venv-torch-<version>), and print one line per version:
#
#   bash scripts/compat.sh                # the lowest torch pyproject.toml admits, and the newest
#   bash scripts/compat.sh 2.4.1 2.15.0   # these releases
#   bash scripts/compat.sh 2.1.2 -- -x    # arguments after -- go to pytest
#
# Each venv gets shareddata (editable), the packages the quick tier imports, and that torch,
# with the pins that release needs (scripts/compat/numpy1.txt for torch 2.1 and 2.2: numpy<2).
# The quick tier is `pytest --quick` (tests/conftest.py) without its two ruff tests: lint
# does not depend on torch. Logs: .venv-torch-<version>/{install,pytest}.log.
# CI stays on the pinned torch (requirements-dev.txt, scripts/test.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
{ # read whole before it runs: editing this file during a run does not change the run

# Lift a machine-wide pip constraint file (pip.conf `constraint = ...`) for these venvs
# only: an empty PIP_CONSTRAINT does not override the config file with pip 23, /dev/null does.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

# What the quick tier imports (tests/conftest.py QUICK_FILES), but not the heavy peers
# (datasets, lightning, tensordict): the one test of Hugging Face files skips without them.
# Upgraded on every run (-U) to the newest the pins allow, so an old venv follows the pins.
TEST_DEPS=(numpy pytest hypothesis psutil tqdm h5py pyarrow pandas tables polars duckdb)

versions=()
pytest_args=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then
        shift
        pytest_args=("$@")
        break
    fi
    versions+=("$1")
    shift
done

if [ ${#versions[@]} -eq 0 ]; then
    floor=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
    released=$("${PYTHON:-python3}" -m pip index versions torch 2>/dev/null |
        sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n' | grep -v '+')
    if [ -z "$floor" ] || [ -z "$released" ]; then
        echo "compat.sh: cannot find torch's floor in pyproject.toml or its releases on the" \
            "index; name the versions: bash scripts/compat.sh 2.1.2 2.15.0" >&2
        exit 2
    fi
    # the lowest release that torch>=floor admits, and the newest release
    lowest=$(printf '%s\n' "$floor" "$released" | sort -V | awk -v f="$floor" 'seen { print; exit } $0 == f { seen = 1 }')
    versions=("$lowest" "$(sort -V <<<"$released" | tail -n1)")
fi

summary=()
status=0
for version in "${versions[@]}"; do
    venv=".venv-torch-$version"
    case "$version" in
    2.[0-2].*) pins=scripts/compat/numpy1.txt ;; # built against numpy 1.x
    *) pins=/dev/null ;;
    esac
    echo "== torch $version: $venv (pins: $pins)"
    start=$SECONDS
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    if ! "$venv/bin/python" -m pip install -U -c "$pins" "torch==$version" -e . \
        "${TEST_DEPS[@]}" >"$venv/install.log" 2>&1; then
        line="torch $version: NOT INSTALLED ($(grep -m1 -E '^ERROR' "$venv/install.log"))"
        echo "$line"
        summary+=("$line")
        status=1
        continue
    fi
    installed=$((SECONDS - start))
    got=$("$venv/bin/python" -c 'import numpy, torch; print(torch.__version__, numpy.__version__)' \
        2>"$venv/import.log") || {
        line="torch $version: DOES NOT IMPORT ($(tail -n1 "$venv/import.log"))"
        echo "$line"
        summary+=("$line")
        status=1
        continue
    }
    start=$SECONDS
    "$venv/bin/python" -m pytest --quick tests -p no:cacheprovider -q \
        --deselect tests/project/test_quality.py::test_ruff_check \
        --deselect tests/project/test_quality.py::test_ruff_format \
        ${pytest_args[@]+"${pytest_args[@]}"} >"$venv/pytest.log" 2>&1
    rc=$?
    took=$((SECONDS - start))
    tail=$(grep -E ' in [0-9.]+s( \(|=|$)' "$venv/pytest.log" | tail -n1)
    count() { grep -oE "[0-9]+ $1" <<<"$tail" | cut -d' ' -f1 | grep . || echo 0; }
    line=$(printf 'torch %-12s numpy %-7s passed %3s  failed %3s  errors %2s  skipped %2s  %4ss (install %ss)' \
        "${got% *}" "${got#* }" "$(count passed)" "$(count failed)" "$(count error)" \
        "$(count skipped)" "$took" "$installed")
    [ "$rc" -eq 0 ] || status=1
    echo "$line"
    grep -E '^(FAILED|ERROR) ' "$venv/pytest.log" | sed 's/^/    /'
    summary+=("$line")
done

echo
echo "== summary (logs in .venv-torch-<version>/pytest.log)"
printf '%s\n' "${summary[@]}"
exit "$status"
}

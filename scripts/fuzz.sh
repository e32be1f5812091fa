#!/usr/bin/env bash
# The long fuzzing run (the default test run replays a short, fixed set of cases).
# Set-up included, like scripts/test.sh. Tunable through the environment:
#   SHAREDDATA_FUZZ_EXAMPLES  hypothesis examples per property  (default here: 500)
#   SHAREDDATA_FUZZ_CASES     mutated files per format           (default here: 2000)
#   SHAREDDATA_FUZZ_SEED      seed of the mutations              (default here: the time)
#   SHAREDDATA_FUZZ_KEEP      folder that keeps every file that failed
# Extra arguments go to pytest, e.g. `bash scripts/fuzz.sh -k parquet`.
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
export SHAREDDATA_FUZZ_EXAMPLES=${SHAREDDATA_FUZZ_EXAMPLES:-500}
export SHAREDDATA_FUZZ_CASES=${SHAREDDATA_FUZZ_CASES:-2000}
export SHAREDDATA_FUZZ_SEED=${SHAREDDATA_FUZZ_SEED:-$(date +%s)}
echo "fuzzing with seed $SHAREDDATA_FUZZ_SEED (rerun with SHAREDDATA_FUZZ_SEED=$SHAREDDATA_FUZZ_SEED)"
python -m pytest tests/sources/test_fuzz.py -p no:cacheprovider -s "$@"

#!/usr/bin/env bash
# make test: the suite as two pytest runs side by side, so that one's waits (a lease to lapse, a
# stream to finish) are the other's CPU time:
#   - the tests that hold models and stacks (tests/clients, tests/engine, tests/stack), in their
#     order, in this terminal: the real models, the session's stack, the memory;
#   - the rest (tests/integration, tests/unit: small processes, real servers), its output kept
#     in a file and printed once both are done (whole if it failed, else its summary).
# Each run has its own guard against processes left behind (tests/process_guard.py). Each collects
# `tests` less the other's folders, so the folders' conftest modules (each imported as `conftest`)
# load in the order a whole run loads them.
# usage: scripts/run_tests.sh PYTHON [pytest arguments...]
set -u
python=$1
shift
models=(tests/clients tests/engine tests/stack)
rest=(tests/integration tests/unit)
log=$(mktemp -t pdserve-tests.XXXXXX)
"$python" -m pytest "$@" tests "${models[@]/#/--ignore=}" >"$log" 2>&1 &
beside=$!
trap 'kill "$beside" 2>/dev/null' INT TERM
"$python" -m pytest --durations=25 "$@" tests "${rest[@]/#/--ignore=}"
status=$?
wait "$beside"
beside_status=$?
echo
echo "== beside it: ${rest[*]} (exit $beside_status)"
if [ "$beside_status" -ne 0 ]; then cat "$log"; else tail -n 3 "$log"; fi
rm -f "$log"
[ "$status" -eq 0 ] && [ "$beside_status" -eq 0 ]

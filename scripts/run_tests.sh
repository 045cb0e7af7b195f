#!/usr/bin/env bash
# make test: the suite as two pytest runs side by side, so that one's waits (a lease to lapse, a
# stream to finish) are the other's CPU time:
#   - the tests that hold the real models and their stacks (tests/clients, tests/engine and the
#     stack tests not listed below), in this terminal: the session's real stack, the memory;
#   - beside them, BESIDE: tests/integration, tests/unit and stack tests that run the fake model
#     only (small processes), its output kept in a file and printed once both are done (whole if
#     it failed, else its summary).
# Each run has its own guard against processes left behind (tests/process_guard.py) and says its
# own peak memory. Each collects `tests` less the other's part, so the folders' conftest modules
# (each imported as `conftest`) load in the order a whole run loads them.
# usage: scripts/run_tests.sh PYTHON [pytest arguments...]
set -u
python=$1
shift
cd "$(dirname "$0")/.."
BESIDE=(tests/integration tests/unit
        tests/stack/test_failures.py tests/stack/test_routing.py tests/stack/test_insider.py
        tests/stack/test_fuzz.py tests/stack/test_dying_loops.py tests/stack/test_supervision.py
        tests/stack/test_enrolled_stack.py tests/stack/test_security.py tests/stack/test_tls.py
        tests/stack/test_hosts.py tests/stack/test_netns.py tests/stack/test_redis_cluster.py
        tests/stack/test_no_transport.py tests/stack/test_stack_start.py tests/stack/test_lent_cores.py)
rest=()
for path in tests/clients tests/engine tests/stack/test_*.py; do
    [[ " ${BESIDE[*]} " == *" $path "* ]] || rest+=("$path")
done
# the package's bytecode cached once, not compiled again in each of the ~300 processes the runs start
unset PYTHONDONTWRITEBYTECODE
# each run's in-process torch on its share of the cores (tests/conftest.py)
export PD_TEST_THREADS=$(( $(nproc) > 3 ? $(nproc) / 2 : 1 ))
log=$(mktemp -t pdserve-tests.XXXXXX)
"$python" -m pytest "$@" tests "${rest[@]/#/--ignore=}" >"$log" 2>&1 &
beside=$!
trap 'kill "$beside" 2>/dev/null' INT TERM
"$python" -m pytest --durations=25 "$@" tests "${BESIDE[@]/#/--ignore=}"
status=$?
wait "$beside"
beside_status=$?
echo
echo "== beside it: ${BESIDE[*]} (exit $beside_status)"
if [ "$beside_status" -ne 0 ]; then cat "$log"; else tail -n 3 "$log"; fi
rm -f "$log"
[ "$status" -eq 0 ] && [ "$beside_status" -eq 0 ]

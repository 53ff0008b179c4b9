#!/usr/bin/env bash
# Set up (if needed), lint and type-check, then run every test that does not need a GPU. Extra arguments go to pytest
# (both runs below), e.g. tests/gateway/test_serve.py, -k NAME, or -n 0 for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh  # ruff and mypy: a finding fails the run before any test starts
PYTHON=${PYTHON:-python3}
# Most tests wait on subprocesses, sockets and timers rather than the CPU, so they run in EMBER_TEST_WORKERS processes
# (default: two per core), a test file per worker at a time (its module-scoped servers are started once). Each test
# has its own EMBER_HOME, ports and servers, so workers share nothing but the machine. Files are handed out longest
# first, as tests/durations.json records them (tests/conftest.py; refresh it with --record-durations
# tests/durations.json), not by their number of tests, so that a long one does not start last.
# One torch (OpenMP) thread per test process and what it starts: OpenMP's threads spin while they wait, and several
# test processes share each core (tests/conftest.py sets the same where pytest is run directly)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
WORKERS=${EMBER_TEST_WORKERS:-$(( $("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))') * 2 ))}
# Tests marked `serial` time or weigh what they do under a load they make themselves (2,000 TLS handshakes, 480 MiB
# of uploads): they run afterwards, one at a time. Exit status 5 is pytest's "no test selected" (e.g. a path given
# holds no serial test); the run fails if either part fails.
status=0
"$PYTHON" -m pytest -q -m "not gpu and not serial" -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@" \
  || status=$?
[ "$status" = 5 ] && status=0
serial=0
"$PYTHON" -m pytest -q -m "not gpu and serial" "$@" || serial=$?
[ "$serial" = 5 ] && serial=0
exit $(( status != 0 ? status : serial ))

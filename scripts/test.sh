#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
#
# One .venv serves the demo and the tests: after the demo's set-up, setup.sh adds only the test tools
# it lacks (scripts/missing_requirements.py). pytest replaces this shell (exec), so Ctrl-C, or SIGINT
# to this script's pid, reaches pytest itself; tests/conftest.py then ends every process the tests
# started, also ranks launched in sessions of their own, which a terminal's Ctrl-C never reaches.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

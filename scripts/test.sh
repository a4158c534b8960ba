#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite on two pytest-xdist workers (tests/conftest.py
# says how tests are grouped). Extra args go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the
# fast subset, or `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}; PY=${PY:-.venv/bin/python}
export JOINTRL_PROGRESS=${JOINTRL_PROGRESS:-0}
exec "$PY" -m pytest -n 2 --dist loadscope --durations=30 "$@"

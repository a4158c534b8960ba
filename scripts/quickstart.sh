#!/usr/bin/env bash
# Install everything (idempotent) and run the main job: the quickstart training run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
JOINTRL=${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/jointrl}; JOINTRL=${JOINTRL:-.venv/bin/jointrl}
exec "$JOINTRL" train configs/quickstart.yaml "$@"

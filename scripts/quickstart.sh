#!/usr/bin/env bash
# Install everything (idempotent) and run the main job: the quickstart training run (configs/quickstart.yaml).
# Its SFT set is an unverified teacher's demonstrations of train tasks, written here (scripts/make_demonstrations.py,
# seeded, so every run gets the same file): terminal-basics with another family's command in half of 48 tasks,
# cad-primitive with the placement ignored in 70% of 48. Extra arguments are config overrides (KEY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=${VIRTUAL_ENV:+$VIRTUAL_ENV/bin}; BIN=${BIN:-.venv/bin}
DEMOS=runs/demos/quickstart
"$BIN/python" scripts/make_demonstrations.py terminal-basics-v0 "$DEMOS-terminal.jsonl" --tasks 48 --wrong 0.5
"$BIN/python" scripts/make_demonstrations.py cad-primitive-v0 "$DEMOS-cad.jsonl" --tasks 48 --wrong 0.7 --mistake pose-blind
cat "$DEMOS-terminal.jsonl" "$DEMOS-cad.jsonl" > "$DEMOS.jsonl"
exec "$BIN/jointrl" train configs/quickstart.yaml "trainer.sft_data=$DEMOS.jsonl" "$@"

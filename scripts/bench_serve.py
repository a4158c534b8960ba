"""Benchmark `jointrl serve`: generated tokens/s through the HTTP server vs the same engine called directly.

One process: it builds the server's `ChatService` (one in-process vLLM engine), runs the FastAPI app
with uvicorn in a background thread, and measures, on the same engine and the same prompts,
  * direct: `RolloutEngine.generate` with B requests at once (the rollout path, no HTTP),
  * http:   B concurrent `/v1/chat/completions` requests (httpx, one thread each, in a child process),
  * http sequential: the same B requests one after another (no batching),
for B in --batches. Every request asks for exactly --new-tokens tokens with thinking uncapped
(thinking_budget "max", a random-weight model rarely emits `<|im_end|>`; the counted tokens are the ones actually
generated). The HTTP client runs in a child process (on this 2-core machine it shares the CPUs
with the engine, as a real client on the same host would).

    .venv/bin/python scripts/bench_serve.py [--batches 16,64] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: list the files in /tmp and explain."}]


def client_main(url: str, model: str, n: int, new_tokens: int, sequential: bool) -> None:
    """Send n requests (concurrently: one thread each) and print {"tokens", "seconds"} as JSON."""
    import httpx

    counts = [0] * n
    with httpx.Client(limits=httpx.Limits(max_connections=n + 4)) as client:
        def one(i: int) -> None:
            r = client.post(url, json={"model": model, "messages": messages(i), "max_tokens": new_tokens, "seed": i,
                                       "thinking_budget": "max"}, timeout=600)
            r.raise_for_status()
            counts[i] = r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        if sequential:
            for i in range(n):
                one(i)
        else:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        print(json.dumps({"tokens": sum(counts), "seconds": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sequential", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seq-requests", type=int, default=4, help="requests in the sequential run")
    ap.add_argument("--model", default=None, help="checkpoint dir or shipped config name (default: a tiny Qwen3-MoE test checkpoint)")
    args = ap.parse_args()
    if args.client:
        return client_main(args.client, args.client_model, args.client_n, args.new_tokens, args.sequential)
    batches = [int(b) for b in args.batches.split(",")]

    import uvicorn

    from model import chat
    from rl.paths import setup_cache_env
    from rl.rollout.engine import GenerateRequest
    from rl.serve import ServeSettings, build_service, create_app
    from tests.helpers.checkpoints import build_test_checkpoint

    setup_cache_env()
    model = args.model or str(build_test_checkpoint(Path(tempfile.gettempdir()) / "jointrl-bench-serve-ckpt"))
    settings = ServeSettings(max_model_len=1024)
    service = build_service(model, settings, record_dir=None)
    app = create_app(service)
    port = 18000 + os.getpid() % 1000
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    name = service.model_names[0]
    tok = service.tokenizer

    def prompt_ids(i: int) -> tuple[int, ...]:
        from jointrl.records import Message

        text = chat.render([Message(role="user", content=messages(i)[0]["content"])], add_generation_prompt=True)
        return tuple(tok.encode(text, add_special_tokens=False))

    def direct(b: int) -> tuple[int, float]:
        reqs = [GenerateRequest(prompt_token_ids=prompt_ids(i), max_tokens=args.new_tokens, stop_token_ids=chat.STOP_TOKEN_IDS,
                                thinking_budget=None, seed=i) for i in range(b)]
        t0 = time.perf_counter()
        res = service.engine.generate(reqs)
        return sum(len(r.token_ids) for r in res), time.perf_counter() - t0

    def run_client(b: int, concurrent: bool) -> tuple[int, float]:
        # The load runs in a child process so that its Python work does not share the server's GIL.
        out = subprocess.run([sys.executable, __file__, "--client", url, "--client-model", name, "--client-n", str(b),
                              "--new-tokens", str(args.new_tokens)] + ([] if concurrent else ["--sequential"]),
                             capture_output=True, text=True, check=True)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        return d["tokens"], d["seconds"]

    def http(b: int) -> tuple[int, float]:
        return run_client(b, True)

    def http_seq(b: int) -> tuple[int, float]:
        return run_client(b, False)

    direct(2)  # warm-up: first requests pay one-off costs
    http(2)
    print(f"model {model} | engine start-up {service.engine.startup_s:.1f}s | {args.new_tokens} new tokens per request | "
          f"{os.cpu_count()} CPUs")
    print(f"{'B':>4} | {'direct tok/s':>12} | {'http tok/s':>10} | {'http/direct':>11}")
    for b in batches:
        n_d, s_d = direct(b)
        n_h, s_h = http(b)
        print(f"{b:>4} | {n_d / s_d:>12.0f} | {n_h / s_h:>10.0f} | {(n_h / s_h) / (n_d / s_d):>10.2f}x")
    n_s, s_s = http_seq(args.seq_requests)
    n_c, s_c = http(args.seq_requests)
    print(f"{args.seq_requests} requests over HTTP: sequential {n_s / s_s:.0f} tok/s | concurrent {n_c / s_c:.0f} tok/s | "
          f"concurrent/sequential {(n_c / s_c) / (n_s / s_s):.2f}x (batching)")
    server.should_exit = True
    th.join(timeout=10)
    service.engine.shutdown()


if __name__ == "__main__":
    main()

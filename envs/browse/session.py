"""One agent's browser: search / open / find over the local web, with the state between calls.

The session keeps the *current view* — the last search-result list or the last opened page — as
numbered lines plus numbered links, so `open(3)` follows link 3 of whatever the agent last looked
at (a search result or a link on a page), `open(cursor=40)` scrolls, and `find("Founded")` searches
the view. Pages are fetched over HTTP from the local server by the host (`BrowseClient`); the agent
only ever sees text. URLs are shown under the virtual host ``http://browse.local`` so transcripts
do not depend on the port the OS picked.

Bad input from the agent (an unknown link number, a foreign host, an empty query) raises
`BrowseInputError` with a message written for the agent; the environment turns it into a tool
error message. This module does not grade and does not know the question.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from envs.browse.index import SearchError
from envs.browse.render import Link, render_html
from envs.browse.server import BrowseClient

VIRTUAL_HOST = "browse.local"
WINDOW_LINES = 40
WINDOW_CHARS = 3000
MAX_FIND_HITS = 20
MAX_PATTERN_CHARS = 200


class BrowseInputError(ValueError):
    """The agent's request cannot be carried out; the message says why and what would work."""


@dataclass(frozen=True)
class View:
    """What the agent is looking at: a page or a search-result list."""

    kind: str  # "page" | "search"
    title: str
    url: str
    lines: tuple[str, ...]
    links: tuple[Link, ...]


def display_url(path: str) -> str:
    return f"http://{VIRTUAL_HOST}{path}"


def to_path(target: str) -> str:
    """A URL under the virtual host, or a bare path, -> the page path; anything else is refused."""
    t = target.strip()
    if t.startswith("/"):
        return t.split("#", 1)[0]
    parts = urlsplit(t)
    if parts.scheme in ("http", "https"):
        if parts.hostname != VIRTUAL_HOST:
            raise BrowseInputError(f"only pages of the offline web at http://{VIRTUAL_HOST}/ can be opened, not {t!r}")
        return parts.path or "/"
    raise BrowseInputError(
        f"open() takes a link number from the current page or search results (e.g. 3), or a URL like "
        f"http://{VIRTUAL_HOST}/wiki/..., got {target!r}")


class BrowseSession:
    """Per-episode browser state. Not thread-safe: one episode drives one session."""

    def __init__(self, client: BrowseClient):
        self.client = client
        self.view: View | None = None
        self.pages_opened: list[str] = []  # paths, in order (a metric, and what tests inspect)
        self.searches = 0

    # -- tools
    def search(self, query: str, k: int = 5) -> str:
        if not query.strip():
            raise BrowseInputError("search() needs a non-empty query")
        try:
            hits = self.client.search(query, k)
        except SearchError as e:
            raise BrowseInputError(str(e)) from None
        self.searches += 1
        lines: list[str] = []
        links: list[Link] = []
        for h in hits:
            links.append(Link(h.rank, h.path, h.title))
            lines.append(f"[{h.title}][{h.rank}] {display_url(h.path)}")
            lines.append(f"    {h.snippet}")
        self.view = View("search", f"Search results for {query!r}", "", tuple(lines), tuple(links))
        if not hits:
            return f"No results for {query!r}. Try other words."
        head = f"Search results for {query!r} ({len(hits)} shown). Open one with open(<number>).\n"
        return head + "\n".join(lines)

    def open(self, target: str | int | None = None, cursor: int = 0) -> str:
        if cursor < 0:
            raise BrowseInputError(f"cursor must be >= 0, got {cursor}")
        if target is None or (isinstance(target, str) and not target.strip()):
            if self.view is None or self.view.kind != "page":
                raise BrowseInputError("no page is open: give a link number or a URL")
            return self._window(cursor)
        # A link number arrives as an int (open(3)) or as digits in a string (open("3")): no URL
        # or path is all digits, so both mean link 3. ASCII only: "²".isdigit() is True but int() refuses it.
        if isinstance(target, bool):
            raise BrowseInputError(f"open() takes a link number or a URL, got {target!r}")
        if isinstance(target, int) or (isinstance(target, str) and target.strip().isascii() and target.strip().isdigit()):
            n = int(target)
            if self.view is None:
                raise BrowseInputError("nothing to follow yet: search() first, or open a URL")
            if not 1 <= n <= len(self.view.links):
                have = f"links 1-{len(self.view.links)}" if self.view.links else "no links"
                raise BrowseInputError(f"there is no link [{n}] in the current view ({have})")
            path = self.view.links[n - 1].href
            if not path.startswith("/"):
                path = to_path(path)
        else:
            path = to_path(target)
        fetched = self.client.page(path)
        if fetched.status == 404:
            raise BrowseInputError(f"404: there is no page at {display_url(path)}")
        if fetched.status != 200:
            raise BrowseInputError(f"HTTP {fetched.status} for {display_url(path)}")
        r = render_html(fetched.body)
        self.view = View("page", r.title or path, display_url(path), r.lines, r.links)
        self.pages_opened.append(path)
        return self._window(cursor)

    def find(self, pattern: str) -> str:
        if self.view is None:
            raise BrowseInputError("no page is open: open() a page before find()")
        pat = pattern.strip().lower()
        if not pat:
            raise BrowseInputError("find() needs a non-empty pattern")
        if len(pat) > MAX_PATTERN_CHARS:
            raise BrowseInputError(f"find() patterns are at most {MAX_PATTERN_CHARS} characters")
        hits = [(i, line) for i, line in enumerate(self.view.lines) if pat in line.lower()]
        if not hits:
            return f"No match for {pattern!r} in {self.view.title}."
        shown = hits[:MAX_FIND_HITS]
        more = f"\n({len(hits) - len(shown)} more matches not shown)" if len(hits) > len(shown) else ""
        return (f"{len(hits)} match(es) for {pattern!r} in {self.view.title}:\n"
                + "\n".join(f"L{i}: {line}" for i, line in shown) + more)

    # -- rendering
    def _window(self, cursor: int) -> str:
        v = self.view
        assert v is not None
        n = len(v.lines)
        if cursor >= max(n, 1):
            raise BrowseInputError(f"cursor {cursor} is past the end of the page ({n} lines)")
        out: list[str] = []
        used = 0
        end = cursor
        while end < n and len(out) < WINDOW_LINES:
            line = f"L{end}: {v.lines[end]}"
            if out and used + len(line) > WINDOW_CHARS:
                break
            out.append(line)
            used += len(line) + 1
            end += 1
        tail = f"\n[lines {cursor}-{end - 1} of {n}; more: open(cursor={end})]" if end < n else f"\n[lines {cursor}-{end - 1} of {n}; end of page]"
        return f"Title: {v.title}\nURL: {v.url}\n" + "\n".join(out) + tail

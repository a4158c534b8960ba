"""HTML -> the text view an agent reads: wrapped lines, with links numbered in document order.

A link renders as ``[anchor text][n]``; `RenderedPage.links[n]` holds its target. Block elements
(p, h1-h6, li, tr, div, br, pre lines) start new lines, table rows render as ``label: value``,
list items as ``* item``. Scripts, styles and HTML comments are dropped (they are not visible on a
real page either), but visible text is kept verbatim — including any instructions planted in it:
the renderer does not try to detect prompt injection, the grader is what makes it harmless.
This module parses only; it does not fetch (see `tools.py`).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from html.parser import HTMLParser

BLOCK_TAGS = frozenset({"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "tr", "ul", "ol", "table",
                        "section", "article", "header", "footer", "title", "dt", "dd", "blockquote"})
SKIP_TAGS = frozenset({"script", "style", "head"})


@dataclass(frozen=True)
class Link:
    number: int
    href: str
    text: str


@dataclass(frozen=True)
class RenderedPage:
    title: str
    lines: tuple[str, ...]
    links: tuple[Link, ...]  # links[i].number == i + 1

    def link(self, number: int) -> Link:
        if not 1 <= number <= len(self.links):
            raise IndexError(number)
        return self.links[number - 1]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class _Renderer(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.cur: list[str] = []
        self.links: list[Link] = []
        self.skip = 0
        self.title: list[str] = []
        self.in_title = False
        self.in_pre = 0
        self.href: str | None = None
        self.anchor: list[str] = []

    def flush(self) -> None:
        text = " ".join("".join(self.cur).split())
        if text:
            self.blocks.append(text)
        self.cur = []

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self.in_title = True
        if tag in SKIP_TAGS:
            self.skip += 1
            return
        if tag in BLOCK_TAGS or tag == "br":
            self.flush()
        if tag == "li":
            self.cur.append("* ")
        elif tag == "pre":
            self.flush()
            self.in_pre += 1
        elif tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.href, self.anchor = href, []
        elif tag == "td":
            self.cur.append(": ")

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
        if tag in SKIP_TAGS:
            self.skip = max(0, self.skip - 1)
            return
        if tag == "a" and self.href is not None:
            text = " ".join("".join(self.anchor).split()) or self.href
            n = len(self.links) + 1
            self.links.append(Link(n, self.href, text))
            self.cur.append(f"[{text}][{n}]")
            self.href = None
        elif tag == "pre":
            self.in_pre = max(0, self.in_pre - 1)
        elif tag in BLOCK_TAGS:
            self.flush()

    def handle_data(self, data):
        if self.in_title:
            self.title.append(data)
        if self.skip:
            return
        if self.in_pre:
            # Keep the line structure of preformatted text: each source line is its own block.
            parts = data.split("\n")
            for i, part in enumerate(parts):
                if i:
                    self.flush()
                self.cur.append(part)
            return
        if self.href is not None:
            self.anchor.append(data)
        else:
            self.cur.append(data)


def render_html(doc: str, width: int = 100) -> RenderedPage:
    """Render an HTML document to numbered-link text lines wrapped at `width` characters."""
    r = _Renderer()
    r.feed(doc)
    r.close()
    r.flush()
    lines: list[str] = []
    for block in r.blocks:
        lines.extend(textwrap.wrap(block, width=width, break_long_words=True, break_on_hyphens=False) or [""])
    title = " ".join("".join(r.title).split())
    return RenderedPage(title=title, lines=tuple(lines), links=tuple(r.links))

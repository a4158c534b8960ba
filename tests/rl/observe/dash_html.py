"""An HTML parser for the report tests: figure ids and kinds, tooltips per figure, sample rows, external references."""
from __future__ import annotations

import re
from html.parser import HTMLParser


class Figures(HTMLParser):
    """Collects figure ids/kinds, <title> texts per figure, samples-table rows, external references."""

    def __init__(self) -> None:
        super().__init__()
        self.kind: dict[str, str] = {}
        self.attrs_of: dict[str, dict] = {}
        self.titles: dict[str, list[str]] = {}
        self.circles: dict[str, list[tuple[float, str]]] = {}
        self.sample_rows: list[str] = []
        self.external: list[str] = []
        self._fig: str | None = None
        self._in_title = False
        self._cy: float | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a and re.match(r"^\s*(https?:)?//", a[k] or ""):
                self.external.append(a[k])
        if tag == "link" or (tag == "script" and "src" in a):
            self.external.append(f"<{tag}>")
        if tag == "figure":
            self._fig = a["id"].removeprefix("plot-")
            self.kind[self._fig] = a.get("data-kind", "")
            self.attrs_of[self._fig] = a
            self.titles[self._fig] = []
            self.circles[self._fig] = []
        if tag == "circle":
            self._cy = float(a["cy"])
        if tag == "title":
            self._in_title = True
        if tag == "tr" and "data-domain" in a:
            self.sample_rows.append(a["data-domain"])

    def handle_endtag(self, tag):
        if tag == "figure":
            self._fig = None
        if tag == "title":
            self._in_title = False
        if tag == "circle":
            self._cy = None

    def handle_data(self, data):
        if self._in_title and self._fig:
            self.titles[self._fig].append(data)
            if self._cy is not None:
                self.circles[self._fig].append((self._cy, data))

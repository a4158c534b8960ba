"""JSON decoding for text a model wrote: every failure is one `ValueError` subclass with a readable message.

Python's `json` fails on hostile input in more ways than `JSONDecodeError`: nesting about 1,000 levels
deep raises `RecursionError` (fewer when the caller is already deep in a stack), and an integer longer
than `sys.get_int_max_str_digits()` (4,300 digits) raises a plain `ValueError`. Parsers of model output
(the chat codec's tool-call parser, `envs.tools.ToolSpec.parse_arguments`) call `loads` / `raw_decode`
here, so that a pathological call becomes an error message for the model instead of an exception that
ends the episode.

Limits: nesting deeper than `max_depth` (default `MAX_DEPTH`, far above what any tool schema needs) is
refused before decoding, by a linear scan of the brackets outside strings, so the decoder never recurses
deeply. `RecursionError` is still caught as a backstop. Size limits are the caller's (the env knows its
`max_arg_chars`). This module decodes only; it does not validate against a schema.
"""
from __future__ import annotations

import json
import re
import sys
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64

# One JSON string literal, unrolled so the regex engine never backtracks: linear in the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_DECODER = json.JSONDecoder()


class JSONInputError(ValueError):
    """Text that is not acceptable JSON: bad syntax, nested too deep, or a number too long to decode."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays / objects in `text`, counting brackets outside string literals.

    Exact for valid JSON; for invalid JSON (an unterminated string) it may over-count, which only ever
    refuses text that would not decode anyway.
    """
    if text.count("[") + text.count("{") == 0:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub('""', text))
    return max(0, max(accumulate(_STEP[c] for c in brackets), default=0))


def _check_depth(text: str, max_depth: int, start: int = 0) -> None:
    # Counting every bracket (strings included) bounds the depth from above: most text needs no scan.
    if text.count("[", start) + text.count("{", start) > max_depth and nesting_depth(text[start:]) > max_depth:
        raise JSONInputError(f"nested deeper than {max_depth} levels")


def _decode(fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except json.JSONDecodeError as e:
        raise JSONInputError(f"{e.msg} at position {e.pos}") from None
    except RecursionError:
        raise JSONInputError("nested too deeply to decode") from None
    except ValueError as e:  # e.g. an integer longer than sys.get_int_max_str_digits()
        msg = str(e)
        if "integer string conversion" in msg:
            msg = f"a number has more than {sys.get_int_max_str_digits()} digits"
        raise JSONInputError(msg[:200]) from None


def loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(text)`, raising only `JSONInputError`."""
    if not isinstance(text, str):
        raise JSONInputError(f"expected JSON text, got {type(text).__name__}")
    _check_depth(text, max_depth)
    return _decode(json.loads, text)


def raw_decode(text: str, idx: int = 0, *, max_depth: int = MAX_DEPTH) -> tuple[Any, int]:
    """`json.JSONDecoder().raw_decode(text, idx)`: one value starting at `idx` and where it ends.

    The depth check covers all of `text[idx:]` (a cheap upper bound on the one value's depth).
    """
    _check_depth(text, max_depth, idx)
    return _decode(_DECODER.raw_decode, text, idx)

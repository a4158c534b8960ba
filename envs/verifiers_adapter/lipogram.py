"""`vf-lipogram-v0`: staros-stardata's lipogram poems with a wider set of forbidden letters and a theme check.

A verifiers environment kept in this file (the adapter loads it by path in the verifiers venv:
`catalog.py` names `<this file>:load_environment`); jointrl's own venv imports it only for its constants, so
the verifiers stack is imported inside the functions.

Why not stardata's `load_lipogram_env` as it ships: its letter is always e, a or o and its rubric never reads
the theme, so one fixed poem without those three letters scores 1 on every prompt. The threat is a policy
that settles on any constant text, or any template, that scores; the rubric here is built so that no single
text can meet more than a few prompts:

- The forbidden letter is one of the 12 most frequent English letters (`LETTERS`), each paired with each
  theme, so a text that avoids a few letters meets only the prompts of those letters.
- The theme: every theme's key words are its words minus function words ("a lighthouse keeper's last
  shift" -> lighthouse, keeper, last, shift). A prompt names the key words that do not hold its letter and
  asks for at least two of them (pairs with fewer than two such words are not generated); fewer than two
  scores 0 (`theme`). One text cannot name every theme: a poem that also names two key words of another theme
  (words the prompt's theme does not share) scores 0 (`focus`), so a list of every theme's words, or a poem
  about two themes at once, earns nothing.
- The shape: 4 to 6 lines, at least 100 letters, at least 12 distinct dictionary words (CMUdict, which
  stardata's syllable counter already loads) making up 80 % of the words; otherwise the reward is scaled by
  0.25, stardata's own degeneracy factor.
- The letter, all or nothing: stardata's lipogram score is 1 without the letter and loses 0.1 per occurrence,
  and its loader adds 0.2 x its surface score (repeated lines) to 0.8 x that. Partial credit is what a template
  collects (one word of every theme, one stray letter each: 0.215 on held-out prompts when it counted), so
  here a poem holding the letter scores 0, and surface scales the rest: 0.8 + 0.2 x surface.

  A letter outside ASCII fails it too: stardata counts only the ASCII letter, so a Cyrillic "е" in place of
  "e" would pass its check while reading as the forbidden letter.

reward = lipogram_ok x (0.8 + 0.2 surface) x shape x theme_ok x focus, in [0, 1].

So one fixed text pays on the prompts of at most one theme (focus), and only for letters it avoids while
naming two of that theme's words, which hold letters of their own: on the 83 held-out prompts, counting only
the letters of the two theme words it names, no text can pay on more than 9 (0.108: "game" and "park" leave 9
of the chess theme's 10 letters; docs/adapters.md has the per-theme counts).

What it does not check: that the poem is good, or about the theme beyond naming it (a deterministic rubric
cannot tell a poem about a lighthouse from a fixed poem with "shift" and "last" spliced in: that template
still needs a poem without the prompt's letter, one per letter, and its theme words in place). Held out: the
last third of stardata's 30 themes, as stardata splits them.
"""
from __future__ import annotations

import re

LETTERS = "etaoinshrdlu"  # the 12 most frequent letters of English text, most frequent first
NEED = 2  # theme words a poem must name
FUNCTION_WORDS = frozenset(
    "a an the of on at in into with over from along above after before by for to and or only once that this its".split())
MIN_LINES, MAX_LINES, MIN_ALPHA = 4, 6, 100
MIN_DICT_WORDS, MIN_DICT_SHARE = 12, 0.8
DEGENERATE = 0.25  # stardata's factor for a poem too short or with too few lines
_WORD = re.compile(r"[a-z]+")
_THINK = re.compile(r"<think>.*?</think>|<think>.*\Z", re.DOTALL)


def key_words(theme: str) -> tuple[str, ...]:
    """The theme's content words, in order, without function words and possessive endings."""
    out: list[str] = []
    for tok in theme.lower().replace("'s", "").split():
        w = "".join(c for c in tok if c.isalpha())
        if w and w not in FUNCTION_WORDS and w not in out:
            out.append(w)
    return tuple(out)


def theme_words(theme: str, letter: str) -> tuple[str, ...]:
    """The theme's key words a poem without `letter` can use."""
    return tuple(w for w in key_words(theme) if letter not in w)


def words_of(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def names(words: set[str], w: str) -> bool:
    """The poem uses key word `w` (or its plural)."""
    return w in words or w + "s" in words or w + "es" in words


def _text(completion) -> str:
    if isinstance(completion, list) and completion:
        completion = completion[-1].get("content", "") if isinstance(completion[-1], dict) else str(completion[-1])
    return _THINK.sub("", completion if isinstance(completion, str) else str(completion or "")).strip()


def parts(text: str, info: dict) -> dict[str, float]:
    """Every factor of the reward for one reply (the module docstring defines them)."""
    from stardata.prompts import TOPICS
    from stardata.schema import FormSpec
    from stardata.verifiers import phonetics
    from stardata.verifiers.composite import verify_text

    rep = verify_text(text, FormSpec.from_dict(info["spec"]))
    lines = [ln for ln in text.splitlines() if ln.strip()]
    words = words_of(text)
    present = set(words)
    in_dict = [w for w in words if phonetics.phones_list(w)]
    shape_ok = (MIN_LINES <= len(lines) <= MAX_LINES and sum(c.isalpha() for c in text) >= MIN_ALPHA
                and len(set(in_dict)) >= MIN_DICT_WORDS and len(in_dict) >= MIN_DICT_SHARE * max(1, len(words)))
    own = set(key_words(info["topic"]))
    hits = sum(names(present, w) for w in info["theme_words"])
    foreign = max((sum(names(present, w) for w in set(key_words(t)) - own) for t in TOPICS if t != info["topic"]), default=0)
    ascii_only = not any(c.isalpha() and not c.isascii() for c in text)
    return {"lipogram": 1.0 if ascii_only and rep.scores.get("lipogram", 0.0) >= 1.0 else 0.0, "surface": float(rep.scores.get("surface", 0.0)),
            "shape": 1.0 if shape_ok else DEGENERATE, "theme": 1.0 if hits >= NEED else 0.0, "focus": 0.0 if foreign >= NEED else 1.0,
            "n_lines": float(len(lines)), "dict_words": float(len(set(in_dict)))}


def themed_lipogram_reward(completion, info=None, **kwargs) -> float:
    p = parts(_text(completion), info)
    return float(p["lipogram"] * (0.8 + 0.2 * p["surface"]) * p["shape"] * p["theme"] * p["focus"])


def themed_lipogram_metrics(completion, info=None, **kwargs) -> dict:
    return parts(_text(completion), info)


def build_rows(holdout: bool = False) -> list[dict]:
    """One prompt per (theme, letter) whose theme keeps at least NEED key words without the letter; stardata's
    themes split as its own loader splits them (first two thirds train, last third held out)."""
    from stardata.prompts import TOPICS, build_prompt
    from stardata.verifiers.form import spec_for_form

    cut = (len(TOPICS) * 2) // 3
    rows: list[dict] = []
    for topic in (TOPICS[cut:] if holdout else TOPICS[:cut]):
        for letter in LETTERS:
            usable = theme_words(topic, letter)
            if len(usable) < NEED:
                continue
            spec = spec_for_form("lipogram", lipogram=letter)
            ask = (f"Name the theme: use at least {NEED} of these words (a plural counts): {', '.join(usable)}. "
                   f"Write {MIN_LINES} to {MAX_LINES} lines of real words, and stay on this one theme.\n")
            prompt = build_prompt(spec, topic).replace("\nOutput ONLY", "\n" + ask + "\nOutput ONLY", 1)
            rows.append({"prompt": prompt, "answer": spec.to_dict(),
                         "info": {"spec": spec.to_dict(), "form": "lipogram", "letter": letter, "topic": topic,
                                  "theme_words": list(usable)}})
    return rows


def load_environment(holdout: bool = False):
    """The verifiers SingleTurnEnv: train themes by default, the held-out third with `holdout=True`."""
    import verifiers as vf
    from datasets import Dataset

    rubric = vf.Rubric(funcs=[themed_lipogram_reward, themed_lipogram_metrics], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(build_rows(holdout)), rubric=rubric)

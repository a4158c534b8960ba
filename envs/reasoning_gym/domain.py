"""The reasoning-gym domains: one question, one answer, graded by reasoning-gym's `score_answer` out of process.

Two answer modes over the same tasks:
- tool mode (the default, what `jointrl envs check` runs): one tool, `answer(text)`, which records the
  first answer and ends the episode;
- final-message mode (`envs.make(id, final_message=True)`): no tools; the first assistant reply without
  tool calls ends the episode, and the answer is the text of its last `<answer>...</answer>` pair, or
  the whole reply stripped when it has none. Only `content` is read, never `reasoning`.

Grading (`check`) runs after the episode, in the framework's grading phase. For the datasets whose
scorer would evaluate the answer as code, `answers.py` decides first: it scores the answer itself from a
strict grammar (`OWN_SCORERS`: puzzle24, countdown, coin_flip), or refuses an answer outside the
dataset's grammar with 0 (`GATES`, metric `answer_refused`); for `ALL_OR_NOTHING` datasets only a full score
counts (their partial credit is collected by constants). Every other answer goes with the task's item
reference to the judge process (`judge.py`), which calls that dataset's `score_answer`. Neither the
answer tool nor anything the policy can reach scores an answer, so no reward signal leaks into the
episode. Reward = the score (reasoning-gym's scores lie in [0, 1]; some give partial credit). No answer,
or an empty one, is 0 without asking the scorer.
"""
from __future__ import annotations

from typing import Mapping

from envs.base import Domain, ToolEnv, ToolInvocation
from envs.reasoning_gym.answers import ALL_OR_NOTHING, GATES, OWN_SCORERS, AnswerRefused
from envs.reasoning_gym.judge import MAX_ANSWER_CHARS, ItemRef, Judge, shared_judge
from envs.reasoning_gym.judge_worker import decode_entry
from envs.tools import tool
from jointrl.records import Message, Task
from rewards.rubric import Rubric, Term
from rewards.terms import check

OPEN, CLOSE = "<answer>", "</answer>"


def final_answer(content: str) -> str:
    """The text of the last <answer>...</answer> pair, else the whole text, stripped.

    Linear in the length (rfind twice), unlike a non-greedy regex, which is quadratic on a reply made
    of many unclosed `<answer>` tags. Same result as reasoning_gym.utils.extract_answer for replies whose
    tags are well nested."""
    end = content.rfind(CLOSE)
    if end >= 0:
        start = content.rfind(OPEN, 0, end)
        if start >= 0:
            return content[start + len(OPEN):end].strip()
    return content.strip()


class _RGBase(Domain):
    rubric = Rubric(terms=(Term("score", check("score"), 1.0),), truncated_reward=0.0, error_reward=0.0)

    def __init__(self, judge: Judge | None = None) -> None:
        self.judge = judge if judge is not None else shared_judge()
        self._answer: str | None = None

    def setup(self, task: Task) -> None:
        self._answer = None

    def given_answer(self, transcript: tuple[Message, ...]) -> str | None:
        return self._answer

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        answer = self.given_answer(transcript)
        metrics = {"answered": 0.0, "answer_chars": float(len(answer or "")), "judge_timeout": 0.0,
                   "judge_crash": 0.0, "scorer_error": 0.0, "answer_too_long": 0.0, "answer_refused": 0.0}
        if answer is None or not answer.strip():
            return {"score": 0.0, **metrics}
        p = task.private
        name = str(p["dataset"])
        if (name in OWN_SCORERS or name in GATES) and len(answer) <= MAX_ANSWER_CHARS:
            entry = decode_entry(str(p["entry"]))
            if name in OWN_SCORERS:
                score = float(OWN_SCORERS[name](answer, entry))
                return {"score": min(1.0, max(0.0, score)), **metrics, "answered": 1.0}
            try:
                GATES[name](answer, entry)
            except AnswerRefused:
                return {"score": 0.0, **metrics, "answered": 1.0, "answer_refused": 1.0}
        v = self.judge.score(ItemRef(dataset=name, seed=int(p["seed"]), size=int(p["size"]),
                                     entry_json=str(p["entry"])), answer)
        if v.outcome != "scored":
            metrics[v.outcome] = 1.0
        score = v.score if name not in ALL_OR_NOTHING or v.score >= 1.0 else 0.0
        return {"score": score, **metrics, "answered": 1.0}

    def reference(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("answer", {"text": str(task.private["reference"])})]

    def noop(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("answer", {"text": ""})]

    def constant_candidates(self, tasks: list[Task]) -> list[str]:
        """Declares a free-text answer domain to the checker's best-constant check; the generic constants and
        the tasks' most frequent references (`private["reference"]`) are what it tries, nothing more."""
        return []


class ReasoningGymDomain(_RGBase):
    """Tool mode: `answer(text)` ends the episode."""

    @tool(ends_episode=True)
    def answer(self, text: str) -> str:
        """Give your final answer. This ends the episode; only the first answer counts.

        Args:
            text: the final answer only, in the format the problem asks for
        """
        if self._answer is None:
            self._answer = text
        return "Answer recorded."


class ReasoningGymFinalMessageDomain(_RGBase):
    """Final-message mode: no tools; the first reply without tool calls is the answer."""

    text_ends_episode = True

    def given_answer(self, transcript: tuple[Message, ...]) -> str | None:
        for m in reversed(transcript):
            if m.role == "assistant":
                if m.tool_calls:
                    return None  # the episode ended some other way (a budget), with no final reply
                # Clip before searching: a reply far over the cap cannot hold a valid answer anyway.
                return final_answer(m.content[-4 * MAX_ANSWER_CHARS:])
        return None


def make_env(final_message: bool = False, judge: Judge | None = None, **toolenv_kw) -> ToolEnv:
    """The factory every rg-* id registers: tool mode by default, `final_message=True` for the other."""
    cls = ReasoningGymFinalMessageDomain if final_message else ReasoningGymDomain
    return ToolEnv(cls(judge=judge), **toolenv_kw)


__all__ = ["make_env", "ReasoningGymDomain", "ReasoningGymFinalMessageDomain", "final_answer", "MAX_ANSWER_CHARS"]

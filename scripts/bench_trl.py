#!/usr/bin/env python
"""jointrl vs TRL's `GRPOTrainer` on CPU: the same model, the same single-turn task, the same sizes.

TRL is the peer a CPU user would pick: its `GRPOTrainer` runs on CPU with transformers' own
`generate` (TRL's vLLM integration is not used here; on CPU plain `generate` is what a TRL user gets).
One run trains both on the same problems and prints, side by side: step time, generated samples/s and
tokens/s, mean completion and prompt lengths, and the jointrl / TRL ratios; then where each side's
step time goes (generate / grade / train / sync). Target: jointrl >= 2x TRL's samples/s.

What is held equal:
- the model: one checkpoint directory (`jointrl models pull`, default the dense SmolLM2-135M-Instruct),
  fp32 on both sides (trainer and generation: vLLM's CPU build in fp32 for jointrl, the trained
  module itself for TRL);
- the task: a reasoning-gym dataset wrapped as the jointrl domain `rg-<name>-v0` in its answer-tool
  mode, one turn (`envs.max_turns=1`). TRL gets the prompt text jointrl's chat codec renders for each
  task (the checkpoint's chat template with the Hermes-style `answer` tool in the system message), so
  prompt tokens are the same ids; its reward function reads the first `answer` call the way jointrl's
  codec (vLLM's `hermes` parser) and `ToolEnv` read it (`answer_of`) and scores it with the same
  out-of-process reasoning-gym judge jointrl grades with (`envs/reasoning_gym/judge.py`, which calls
  the dataset's `score_answer`);
- the problems, in order: jointrl's sampler is replayed here (`DomainSampler`, same seed) and TRL
  reads the same tasks in the same order (`shuffle_dataset=False`); jointrl's logged task ids are
  checked against the replay;
- group size, prompts per step, max new tokens, temperature 1 / top-p 1, no top-k, lr, AdamW betas
  (0.9, 0.95), no weight decay, grad-norm clip 1, one optimiser step per batch, trained in micro-batches of
  `--micro-batch` sequences (default 2: with 16 x ~340 tokens in one micro-batch jointrl's fp32 trainer
  reached 11 GB, with 4 it reached 5.8 GB, and on this shared 24 GiB machine Ray's memory monitor killed
  the run's workers whenever other jobs' memory peaked), no KL term, GRPO advantages normalised by the group's std, the clipped surrogate with
  clip range (0.2, 0.28) and per-sequence token-mean aggregation (jointrl `seq_mean_token_mean`,
  TRL `loss_type="grpo"`); no dynamic sampling (every group is trained on, on both sides).

What is not equal, by design (each side as shipped): jointrl syncs the weights to the engine and
measures the engine-vs-trainer logprob gap every step; TRL generates with the trained module itself
and does neither. jointrl's trainer runs one
torch thread (`JOINTRL_TRAINER_THREADS`, default 1) beside the vLLM engine; TRL runs one process with
`--trl-threads` torch threads (default 1: on this shared, oversubscribed 2-core machine torch's
default of one thread per core made TRL's forward 2.5x and its generate 5x slower than one thread;
`--trl-threads 0` keeps torch's default). TRL's gradient checkpointing (its default) is off: on CPU it
costs TRL time. Both sides run fp32 unless `--bf16`, which puts each side in its own bf16 mode (jointrl:
bf16 weights in DeepSpeed, the engine and the sync; TRL: accelerate's bf16 autocast over fp32 weights).

Timing: the first `--warmup` steps of each side are dropped (engine / allocator warm-up). jointrl's
step times come from its metrics.jsonl (`time/*`, rl/observe/telemetry.py: time_breakdown); TRL's from a
callback around each optimiser step, with its `generate` and reward calls timed inside it. The sides
run one after the other (jointrl first), never at once; the load average is recorded for each.

TRL lives in its own virtualenv (`.cache/trl-venv/`, built on first use from pinned versions:
`ensure_trl_venv`), so its pins never touch the project's .venv. This file is also the TRL-side
worker (`--trl-worker`, run by that venv's Python); the worker imports nothing of this repository
except the judge, loaded by file path.

    .venv/bin/python scripts/bench_trl.py [--dataset basic_arithmetic] [--prompts 4] [--generations 4]
        [--max-new-tokens 64] [--steps 3] [--warmup 1] [--micro-batch 2] [--lr 1e-6] [--seed 0]
        [--model smollm2-135m] [--trl-threads 1] [--jointrl-threads 1]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".cache" / "trl-venv"
JUDGE_PY = ROOT / "envs" / "reasoning_gym" / "judge.py"
DOMAIN = "rg"  # the config name of the one domain jointrl trains on here
TARGET_SAMPLES_RATIO = 2.0  # the goal: jointrl >= 2x TRL's generated samples/s

# The TRL side's pins beside the project's own (read from pyproject.toml, so both venvs run the same
# transformers / datasets / reasoning-gym / torch). trl 1.13.0 installs cleanly over transformers
# 5.19.0 and torch 2.13.0; it imports `requests` without declaring it, hence the explicit pin.
TRL_PINS = ("trl==1.13.0", "accelerate==1.15.0", "requests==2.34.2")
SHARED_PINS = ("transformers", "datasets", "reasoning-gym")


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class BenchSpec:
    """One benchmark run: the sizes both sides share."""

    dataset: str = "basic_arithmetic"  # reasoning-gym dataset; jointrl domain rg-<dataset>-v0
    prompts: int = 4                   # prompts (tasks) per optimiser step
    generations: int = 4               # samples per prompt (GRPO group size)
    max_new_tokens: int = 64           # completion cap (jointrl max_new_tokens_per_turn, TRL max_completion_length)
    steps: int = 3                     # measured optimiser steps per side
    warmup: int = 1                    # steps run before the measured ones and dropped, per side
    micro_batch: int = 2               # sequences per forward/backward; the batch accumulates into one optimiser step
    temperature: float = 1.0
    lr: float = 1e-6
    seed: int = 0                      # jointrl's envs/model seed (its sampler's task order) and TRL's seed
    model: str = "smollm2-135m"        # a `jointrl models pull` name
    trl_threads: int = 1               # torch threads of the TRL process; 0 = torch's default (one per core)
    jointrl_threads: int = 1           # jointrl's trainer.threads_per_rank and rollout.threads_per_worker
    bf16: bool = False                 # each side's bf16 mode: jointrl bf16 weights (trainer, engine, sync); TRL bf16 autocast
    gap_every: int = 1                 # jointrl's logging.gap_every: the post-sync engine-vs-trainer check every k steps (0 = off)
    prefix_sharing: str = "auto"       # jointrl's trainer.prefix_sharing: a group's shared prompt computed once (off: padded rows)
    out: str = "runs/bench-trl"        # run directories and results.json

    @property
    def env_id(self) -> str:
        return f"rg-{self.dataset}-v0"

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def batch(self) -> int:
        return self.prompts * self.generations

    def out_dir(self) -> Path:
        p = Path(self.out)
        return p if p.is_absolute() else ROOT / p


def parse_args(argv: Sequence[str] | None = None) -> BenchSpec:
    d = BenchSpec()
    p = argparse.ArgumentParser(prog="scripts/bench_trl.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=d.dataset, help="reasoning-gym dataset (jointrl domain rg-<name>-v0)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per optimiser step")
    p.add_argument("--generations", type=int, default=d.generations, help="samples per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="completion length cap")
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps dropped before the measured ones, per side")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help="sequences per forward/backward on both sides (must divide prompts x generations)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model", default=d.model, help="a `jointrl models pull` name (a checkpoint both sides load)")
    p.add_argument("--trl-threads", type=int, default=d.trl_threads,
                   help="torch threads of the TRL process (0: torch's default, one per core); see docs/peers.md")
    p.add_argument("--jointrl-threads", type=int, default=d.jointrl_threads,
                   help="torch threads of jointrl's trainer rank and of its rollout engine (trainer.threads_per_rank, "
                        "rollout.threads_per_worker); the two never run at once in a synchronous step")
    p.add_argument("--bf16", action="store_true",
                   help="each side's bf16 mode: jointrl's trainer, engine and sync in bf16 (model.dtype, rollout.dtype, "
                        "trainer.sync_format); TRL's bf16 autocast over fp32 weights (GRPOConfig bf16=True)")
    p.add_argument("--gap-every", type=int, default=d.gap_every,
                   help="jointrl's logging.gap_every: run the post-sync engine-vs-trainer logprob check every k steps "
                        "(0: never); TRL has no such check")
    p.add_argument("--prefix-sharing", default=d.prefix_sharing, choices=["auto", "on", "off"],
                   help="jointrl's trainer.prefix_sharing (rl/trainer/packing.py): a group's shared prompt in one forward "
                        "(auto, the default), or padded rows like TRL's (off)")
    p.add_argument("--out", default=d.out, help="where run directories and results.json go (relative: to the repo)")
    p.add_argument("--trl-worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # internal: the TRL side
    a = p.parse_args(argv)
    for name in ("prompts", "generations", "max_new_tokens", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.jointrl_threads < 1:
        p.error(f"--jointrl-threads must be >= 1, got {a.jointrl_threads}")
    if a.gap_every < 0:
        p.error(f"--gap-every must be >= 0 (0: never), got {a.gap_every}")
    if a.trl_threads < 0:
        p.error(f"--trl-threads must be >= 0 (0: torch's default), got {a.trl_threads}")
    if a.micro_batch < 1 or (a.prompts * a.generations) % a.micro_batch:
        p.error(f"--micro-batch must be >= 1 and divide prompts x generations = {a.prompts * a.generations}, "
                f"got {a.micro_batch}")
    if a.generations < 2:
        p.error(f"--generations must be >= 2 (GRPO normalises within a group), got {a.generations}")
    if not a.temperature > 0:
        p.error(f"--temperature must be > 0 (GRPO samples its groups), got {a.temperature}")
    if not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    if not re.fullmatch(r"[a-z0-9_]+", a.dataset):
        p.error(f"--dataset must be a reasoning-gym dataset name (lower case, digits, '_'), got {a.dataset!r}")
    return BenchSpec(dataset=a.dataset, prompts=a.prompts, generations=a.generations, max_new_tokens=a.max_new_tokens,
                     steps=a.steps, warmup=a.warmup, micro_batch=a.micro_batch, temperature=a.temperature, lr=a.lr,
                     seed=a.seed, model=a.model,
                     trl_threads=a.trl_threads, jointrl_threads=a.jointrl_threads, bf16=a.bf16, gap_every=a.gap_every,
                     prefix_sharing=a.prefix_sharing, out=a.out)


def jointrl_overrides(spec: BenchSpec, model_dir: Path, run_dir: Path) -> list[str]:
    """The dotted overrides of jointrl's run (rl/config.py): one turn, one domain, the shared sizes."""
    n = spec.max_new_tokens
    dtype = "bfloat16" if spec.bf16 else "float32"
    return [
        "name=bench-trl-jointrl", f"run_dir={run_dir}",
        f"model.arch={model_dir}", f"model.dtype={dtype}", f"model.seed={spec.seed}",
        f"rollout.dtype={dtype}", f"trainer.sync_format={'bf16' if spec.bf16 else 'fp32'}", f"rollout.max_new_tokens_per_turn={n}", f"rollout.temperature={spec.temperature}",
        "rollout.top_p=1.0", f"rollout.max_model_len={1024 + n}", "rollout.kv_cache_gib=0.5",
        # the rg tasks carry the "low" thinking tier; with no reasoning format a tier's budget caps the
        # turn's tokens, so every tier is uncapped and max_new_tokens_per_turn alone bounds the completion
        "rollout.thinking_budgets={low: -1, high: -1, max: -1}",
        f"envs.weights={{{DOMAIN}: 1.0}}", f"envs.env_ids.{DOMAIN}={spec.env_id}", "envs.max_turns=1",
        f"envs.seed={spec.seed}",
        "algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip", "algorithm.aggregation=seq_mean_token_mean",
        f"algorithm.group_size={spec.generations}", "algorithm.dynamic_sampling=off", "algorithm.kl_coef=0.0",
        "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        f"trainer.lr={spec.lr}", "trainer.weight_decay=0.0", "trainer.grad_clip=1.0", "trainer.warmup_steps=0",
        f"trainer.tasks_per_step={spec.prompts}", f"trainer.micro_batch_size={spec.micro_batch}",
        f"trainer.prefix_sharing={spec.prefix_sharing}",
        f"trainer.threads_per_rank={spec.jointrl_threads}", f"rollout.threads_per_worker={spec.jointrl_threads}",
        f"trainer.steps={spec.total_steps}", "trainer.sft_steps=0", "trainer.checkpoint_every=0", "trainer.resume=false",
        "eval.n_per_domain=1", "eval.samples=1",
        f"logging.samples_per_domain={spec.batch}", "logging.wandb_mode=disabled", f"logging.gap_every={spec.gap_every}",
    ]


def trl_config_kwargs(spec: BenchSpec, output_dir: str) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments holding the same settings as `jointrl_overrides`."""
    return dict(
        # the whole batch is generated at once, then trained in micro-batches accumulated into one step
        output_dir=output_dir, per_device_train_batch_size=spec.micro_batch,
        gradient_accumulation_steps=spec.batch // spec.micro_batch, steps_per_generation=spec.batch // spec.micro_batch,
        num_generations=spec.generations, max_completion_length=spec.max_new_tokens, temperature=spec.temperature,
        top_p=1.0, top_k=0, learning_rate=spec.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, beta=0.0, num_iterations=1, loss_type="grpo",
        scale_rewards="group", epsilon=0.2, epsilon_high=0.28, max_steps=spec.total_steps, shuffle_dataset=False,
        seed=spec.seed, use_cpu=True, bf16=spec.bf16, fp16=False, gradient_checkpointing=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
        log_completions=False,
    )


# ----------------------------------------------------------------------------- the answer, as jointrl reads it
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's hermes parser's pattern


def answer_of(text: str, *, max_calls: int = 8, max_arg_chars: int = 65_536) -> str | None:
    """The answer jointrl's rg domain would record from one generated turn, or None.

    Mirrors the path a reply takes there: vLLM's `hermes` tool parser (every `<tool_call>` block,
    the last one possibly unclosed, must be a JSON object with a "name" and "arguments", or no call is
    read at all), then `ToolEnv`: calls past `max_calls` are skipped, and the first call named `answer`
    whose arguments are exactly {"text": <string>} (as JSON text of at most `max_arg_chars`) records the
    answer. Checked against the real codec and environment by tests/scripts/test_bench_trl.py.
    """
    if "<tool_call>" not in text:
        return None
    try:
        calls = [json.loads(a if a else b) for a, b in _TOOL_CALL.findall(text)]
        named = [(c["name"], c["arguments"]) for c in calls]
    except Exception:  # noqa: BLE001 - the parser reads no call at all from such a reply
        return None
    if not all(isinstance(name, str) for name, _ in named):
        return None
    for name, args in named[:max_calls]:
        if name != "answer":
            continue
        if len(json.dumps(args, ensure_ascii=False)) > max_arg_chars:
            continue
        if isinstance(args, dict) and set(args) == {"text"} and isinstance(args["text"], str):
            return args["text"]
    return None


class CompletionScorer:
    """TRL's reward function body: completion ids -> the reward jointrl's rg domain gives the same reply.

    The completion is decoded with special tokens kept and its closing eos dropped (what jointrl's codec
    parses), the answer read by `answer_of`, and scored by the judge (`envs/reasoning_gym/judge.py`:
    the dataset's `score_answer` in a forked, audited child process, clamped to [0, 1]). No answer, or an
    empty one, is 0 without a scorer call, as the domain's `check`. The judge and its `ItemRef` come in
    as arguments: the TRL worker loads them by file path, a test imports them."""

    def __init__(self, *, decode, eos_id: int, judge, item_ref, max_calls: int, max_arg_chars: int) -> None:
        self.decode, self.eos_id, self.judge, self.item_ref = decode, eos_id, judge, item_ref
        self.max_calls, self.max_arg_chars = max_calls, max_arg_chars

    def __call__(self, completion_ids: Sequence[Sequence[int]], dataset: Sequence[str], rg_seed: Sequence[int],
                 size: Sequence[int], entry: Sequence[str]) -> list[float]:
        out = []
        for ids, ds, seed, n, e in zip(completion_ids, dataset, rg_seed, size, entry, strict=True):
            body = list(ids[:-1]) if len(ids) and ids[-1] == self.eos_id else list(ids)
            ans = answer_of(self.decode(body), max_calls=self.max_calls, max_arg_chars=self.max_arg_chars)
            if ans is None or not ans.strip():
                out.append(0.0)
                continue
            v = self.judge.score(self.item_ref(dataset=ds, seed=int(seed), size=int(n), entry_json=e), ans)
            out.append(float(v.score))
        return out


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class StepRecord:
    """One measured optimiser step of one side."""

    step_s: float
    generate_s: float
    grade_s: float        # reward: the judge's score_answer calls (jointrl: its grading phase)
    train_s: float        # jointrl: old logprobs + update (trainer busy); TRL: the rest of the step
    sync_s: float         # weight sync to the engine (TRL generates with the trained module: 0)
    samples: int          # completions generated
    generated_tokens: int
    reward_mean: float

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.generate_s - self.grade_s - self.train_s - self.sync_s, 0.0)


@dataclass(frozen=True)
class SideResult:
    name: str
    steps: tuple[StepRecord, ...]          # the measured steps, warm-up dropped
    prompt_tokens_mean: float
    load_avg: tuple[float, float]          # 1-minute load average before / after the side ran
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"{self.name}: no measured steps")

    @property
    def step_s(self) -> float:
        return sum(s.step_s for s in self.steps) / len(self.steps)

    @property
    def samples_per_s(self) -> float:
        return sum(s.samples for s in self.steps) / sum(s.step_s for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return sum(s.generated_tokens for s in self.steps) / sum(s.step_s for s in self.steps)

    @property
    def completion_mean(self) -> float:
        return sum(s.generated_tokens for s in self.steps) / sum(s.samples for s in self.steps)

    @property
    def generate_samples_per_s(self) -> float:
        """Samples per second of generation alone (the engine's share of the step)."""
        g = sum(s.generate_s for s in self.steps)
        return sum(s.samples for s in self.steps) / g if g > 0 else float("nan")

    @property
    def reward_mean(self) -> float:
        return sum(s.reward_mean * s.samples for s in self.steps) / sum(s.samples for s in self.steps)

    def part_mean(self, part: str) -> float:
        return sum(getattr(s, f"{part}_s") for s in self.steps) / len(self.steps)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SideResult":
        return cls(name=str(d["name"]), steps=tuple(StepRecord(**s) for s in d["steps"]),
                   prompt_tokens_mean=float(d["prompt_tokens_mean"]), load_avg=tuple(d["load_avg"]),
                   notes=tuple(d.get("notes", ())))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def format_table(j: SideResult, t: SideResult) -> str:
    """The side-by-side table: per side figures, jointrl / TRL ratios, then each side's step split."""
    rows = [
        ("step time (s)", j.step_s, t.step_s, "{:.2f}"),
        ("generated samples/s", j.samples_per_s, t.samples_per_s, "{:.2f}"),
        ("generated tokens/s", j.tokens_per_s, t.tokens_per_s, "{:.1f}"),
        ("mean completion length (tokens)", j.completion_mean, t.completion_mean, "{:.1f}"),
        ("mean prompt length (tokens)", j.prompt_tokens_mean, t.prompt_tokens_mean, "{:.1f}"),
        ("samples/s of generation alone", j.generate_samples_per_s, t.generate_samples_per_s, "{:.2f}"),
        ("mean reward", j.reward_mean, t.reward_mean, "{:.3f}"),
    ]
    lines = [f"| {'':<33} | {j.name:>9} | {t.name:>9} | {j.name + ' / ' + t.name:>13} |",
             f"|{'-' * 35}|{'-' * 11}|{'-' * 11}|{'-' * 15}|"]
    for label, a, b, fmt in rows:
        lines.append(f"| {label:<33} | {fmt.format(a):>9} | {fmt.format(b):>9} | {_ratio(a, b):>13} |")
    lines.append("")
    lines.append("where a step goes (mean s): step = generate + grade + train + sync + other")
    for side in (j, t):
        parts = " + ".join(f"{p} {side.part_mean(p):.2f}" for p in ("generate", "grade", "train", "sync", "other"))
        lines.append(f"  {side.name:<8} {side.step_s:.2f} = {parts}")
    lines.append("")
    r = j.samples_per_s / t.samples_per_s if t.samples_per_s > 0 else float("nan")
    verdict = "met" if r >= TARGET_SAMPLES_RATIO else "missed"
    lines.append(f"target: {j.name} >= {TARGET_SAMPLES_RATIO:.1f}x {t.name}'s generated samples/s: {r:.2f}x ({verdict})")
    lines.append(f"measured steps: {len(j.steps)} ({j.name}), {len(t.steps)} ({t.name}); "
                 f"1-min load average before/after: {j.name} {j.load_avg[0]:.1f}/{j.load_avg[1]:.1f}, "
                 f"{t.name} {t.load_avg[0]:.1f}/{t.load_avg[1]:.1f}")
    for side in (j, t):
        for n in side.notes:
            lines.append(f"note ({side.name}): {n}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- prompts (jointrl's, replayed)
@dataclass(frozen=True)
class PromptRow:
    """One task as both sides see it: the rendered prompt and what the judge needs to score it."""

    task_id: str
    prompt: str            # the prompt ids jointrl's codec renders, as text (re-encodes to the same ids)
    prompt_tokens: int
    dataset: str
    rg_seed: int
    size: int
    entry: str             # the task's entry JSON (question, answer, metadata), as the judge takes it


@dataclass(frozen=True)
class AnswerLimits:
    """How the rg domain's `ToolEnv` bounds one reply's calls (read from the env, handed to `answer_of`)."""

    max_calls: int         # calls past this in one reply are skipped
    max_arg_chars: int     # a call's arguments longer than this (as JSON text) are refused


def replay_prompts(spec: BenchSpec, model_dir: Path) -> tuple[list[list[PromptRow]], AnswerLimits]:
    """The tasks jointrl's driver will draw at each step (its `DomainSampler`, same pool and seed),
    rendered by the codec the driver builds; and the answer-reading limits of the domain's env."""
    import asyncio

    import envs
    from jointrl.records import Task
    from rl.config import load_config
    from rl.rollout.codec import make_codec, resolve_codec_name
    from rl.sampler import DomainSampler

    cfg = load_config(None, jointrl_overrides(spec, model_dir, spec.out_dir() / "jointrl"))
    codec = make_codec(resolve_codec_name(cfg.model.chat_codec, cfg.model.arch), model_dir,
                       tool_parser=cfg.model.tool_parser, reasoning_parser=cfg.model.reasoning_parser)
    pool = [Task.from_row(r) for r in envs.tasks(spec.env_id, "train", seed=cfg.envs.seed)]
    sampler = DomainSampler({DOMAIN: pool}, dict(cfg.envs.weights), seed=cfg.envs.seed)
    env = envs.make(spec.env_id)
    limits = AnswerLimits(max_calls=int(env.max_calls_per_turn), max_arg_chars=int(pool[0].limits.max_arg_chars))
    steps: list[list[PromptRow]] = []
    for _ in range(spec.total_steps):
        rows = []
        for task in sampler.sample(spec.prompts):
            messages, tools = asyncio.run(env.reset(task))
            ids = codec.prompt_ids(messages, tools)
            text = codec.tokenizer.decode(ids, skip_special_tokens=False)
            if list(codec.tokenizer(text=text)["input_ids"]) != list(ids):
                raise RuntimeError(f"{task.id}: the rendered prompt does not re-encode to the same ids; "
                                   "TRL would not see the prompt jointrl sends")
            p = task.private
            rows.append(PromptRow(task_id=task.id, prompt=text, prompt_tokens=len(ids), dataset=str(p["dataset"]),
                                  rg_seed=int(p["seed"]), size=int(p["size"]), entry=str(p["entry"])))
        steps.append(rows)
    env.close()
    return steps, limits


# ----------------------------------------------------------------------------- jointrl side
def jointrl_steps(rows: Sequence[dict[str, Any]], warmup: int) -> tuple[StepRecord, ...]:
    """The measured steps from jointrl's metrics.jsonl rows (the driver's step rows; warm-up dropped)."""
    steps = sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])[warmup:]
    out = []
    for r in steps:
        n = int(r[f"episodes/count/{DOMAIN}"])
        out.append(StepRecord(step_s=r["time/step_s"], generate_s=r["time/rollout_generate_s"],
                              grade_s=r["time/rollout_grade_s"] + r["time/rollout_tools_s"], train_s=r["time/train_s"],
                              sync_s=r["time/sync_s"], samples=n,
                              generated_tokens=round(r[f"tokens/response_mean/{DOMAIN}"] * n),
                              reward_mean=r["reward/mean/all"]))
    return tuple(out)


def run_jointrl(spec: BenchSpec, model_dir: Path, plan: list[list[PromptRow]]) -> SideResult:
    from rl.config import load_config
    from rl.observe.sink import read_metrics
    from rl.run import run

    run_dir = spec.out_dir() / "jointrl"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, jointrl_overrides(spec, model_dir, run_dir))
    load0 = os.getloadavg()[0]
    run(cfg)
    load1 = os.getloadavg()[0]
    notes = []
    drawn: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        drawn.setdefault(int(s["step"]), []).append(s["task_id"])
    for step, rows in enumerate(plan):
        want = sorted(r.task_id for r in rows for _ in range(spec.generations))
        if sorted(drawn.get(step, [])) != want:
            notes.append(f"step {step}: the driver drew other tasks than the replayed sampler; TRL's prompts differ")
    return SideResult(name="jointrl", steps=jointrl_steps(read_metrics(run_dir), spec.warmup),
                      prompt_tokens_mean=_prompt_mean(plan[spec.warmup:]), load_avg=(load0, load1), notes=tuple(notes))


def _prompt_mean(plan: Sequence[Sequence[PromptRow]]) -> float:
    n = [r.prompt_tokens for rows in plan for r in rows]
    return sum(n) / len(n)


# ----------------------------------------------------------------------------- TRL side (orchestrator)
def _pyproject_pin(name: str) -> str:
    """`name==version` as pyproject.toml pins it (the project's single source for shared versions)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"({re.escape(name)}==[^"\s]+)"', text)
    if not m:
        raise RuntimeError(f"pyproject.toml pins no exact version of {name}")
    return m.group(1)


def trl_requirements() -> tuple[str, ...]:
    return tuple(_pyproject_pin(n) for n in SHARED_PINS) + TRL_PINS


def ensure_trl_venv(venv: Path = TRL_VENV) -> Path:
    """TRL's own virtualenv, built once (file-locked; a stamp names the pins it was built with).

    torch goes in first, alone: pip then takes the CPU wheel this machine keeps on disk, and nothing
    later can pull a CUDA build in its place (as scripts/setup.sh does for the project's venv)."""
    from jointrl.paths import cache_lock

    torch_pin = _pyproject_pin("torch")
    reqs = trl_requirements()
    stamp = venv / (".bench-trl-" + hashlib.sha256("\n".join((torch_pin,) + reqs).encode()).hexdigest()[:16])
    py = venv / "bin" / "python"
    with cache_lock(venv.parent / ".trl-venv.lock"):
        if stamp.exists():
            return py
        print(f"bench_trl: building TRL's virtualenv in {venv} ({', '.join((torch_pin,) + reqs)})", flush=True)
        if not py.exists():
            base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", torch_pin], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *reqs], check=True)
        subprocess.run([str(py), "-c", "from trl import GRPOTrainer, GRPOConfig"], check=True)
        for old in venv.glob(".bench-trl-*"):
            old.unlink()
        stamp.touch()
    return py


@dataclass(frozen=True)
class TrlWorkerSpec:
    """What the TRL worker needs, written as JSON for the other venv's Python."""

    bench: BenchSpec
    model_dir: str
    dataset_path: str      # JSONL of PromptRow, in jointrl's draw order
    result_path: str
    output_dir: str
    judge_py: str
    max_calls: int
    max_arg_chars: int


def run_trl(spec: BenchSpec, model_dir: Path, plan: list[list[PromptRow]], limits: AnswerLimits) -> SideResult:
    py = ensure_trl_venv()
    work = spec.out_dir() / "trl"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(asdict(r)) + "\n" for rows in plan for r in rows))
    ws = TrlWorkerSpec(bench=spec, model_dir=str(model_dir), dataset_path=str(data), result_path=str(work / "result.json"),
                       output_dir=str(work / "trainer"), judge_py=str(JUDGE_PY), **asdict(limits))
    spec_path = work / "worker_spec.json"
    spec_path.write_text(json.dumps(asdict(ws)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(ROOT / ".cache" / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    for k in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(k, None)
    load0 = os.getloadavg()[0]
    subprocess.run([str(py), str(Path(__file__).resolve()), "--trl-worker", str(spec_path)], check=True, env=env, cwd=str(work))
    load1 = os.getloadavg()[0]
    d = json.loads((work / "result.json").read_text())
    d["load_avg"] = (load0, load1)
    return SideResult.from_json(d)


# ----------------------------------------------------------------------------- TRL side (worker, TRL's venv)
def _load_judge(path: str):
    """envs/reasoning_gym/judge.py by file path (standard library only; its worker runs under this Python)."""
    s = importlib.util.spec_from_file_location("bench_trl_judge", path)
    mod = importlib.util.module_from_spec(s)
    sys.modules[s.name] = mod  # dataclasses look their module up while the file executes
    s.loader.exec_module(mod)
    return mod


def trl_worker(spec_path: str) -> int:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    raw = json.loads(Path(spec_path).read_text())
    bench = BenchSpec(**raw.pop("bench"))
    ws = TrlWorkerSpec(bench=bench, **raw)
    judge_mod = _load_judge(ws.judge_py)
    judge = judge_mod.Judge()
    rows = [json.loads(line) for line in Path(ws.dataset_path).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(ws.model_dir)
    prompt_tokens = [len(tok(text=r["prompt"])["input_ids"]) for r in rows]
    if bench.trl_threads > 0:
        torch.set_num_threads(bench.trl_threads)
    model = AutoModelForCausalLM.from_pretrained(ws.model_dir, dtype=torch.float32)

    scorer = CompletionScorer(decode=lambda ids: tok.decode(ids, skip_special_tokens=False), eos_id=tok.eos_token_id,
                              judge=judge, item_ref=judge_mod.ItemRef, max_calls=ws.max_calls, max_arg_chars=ws.max_arg_chars)
    timing: dict[str, list[float]] = {"generate": [], "grade": []}
    counts: dict[str, list[float]] = {"samples": [], "tokens": [], "reward": []}
    seen_ids: list[list[str]] = []  # task ids scored per generation batch, to check TRL kept jointrl's order

    def reward(prompts, completions, completion_ids, **columns):
        t0 = time.perf_counter()
        seen_ids.append(list(columns["task_id"]))
        out = scorer(completion_ids, columns["dataset"], columns["rg_seed"], columns["size"], columns["entry"])
        timing["grade"].append(time.perf_counter() - t0)
        counts["samples"].append(len(out))
        counts["tokens"].append(sum(len(c) for c in completion_ids))
        counts["reward"].append(sum(out) / len(out))
        return out

    class TimedGRPO(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):  # trl 1.13: the one call to transformers' generate
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                timing["generate"].append(time.perf_counter() - t0)

    if not hasattr(GRPOTrainer, "_generate_single_turn"):
        raise RuntimeError(f"trl {trl.__version__} has no GRPOTrainer._generate_single_turn to time; pin trl==1.13.0")

    steps: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.marks = {k: len(v) for k, v in {**timing, **counts}.items()}

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            new = {k: v[self.marks[k]:] for k, v in {**timing, **counts}.items()}
            if len(new["generate"]) != 1 or len(new["samples"]) != 1:
                raise RuntimeError(f"expected one generation and one reward call per optimiser step, got "
                                   f"{len(new['generate'])} and {len(new['samples'])}")
            gen, grade = new["generate"][0], new["grade"][0]
            steps.append({"step_s": dt, "generate_s": gen, "grade_s": grade, "train_s": max(dt - gen - grade, 0.0),
                          "sync_s": 0.0, "samples": int(new["samples"][0]), "generated_tokens": int(new["tokens"][0]),
                          "reward_mean": float(new["reward"][0])})

    args = GRPOConfig(**trl_config_kwargs(bench, ws.output_dir))
    trainer = TimedGRPO(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    judge.close()
    measured = steps[bench.warmup:]
    n_prompts = bench.prompts * bench.warmup
    notes = [f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch threads, {'bf16 autocast over fp32 weights' if bench.bf16 else 'fp32'}, "
             "transformers' generate (no vLLM)"]
    for k, ids in enumerate(seen_ids):
        want = sorted(r["task_id"] for r in rows[k * bench.prompts:(k + 1) * bench.prompts] for _ in range(bench.generations))
        if sorted(ids) != want:
            notes.append(f"step {k}: TRL scored other tasks than jointrl drew at that step")
    Path(ws.result_path).write_text(json.dumps({
        "name": "TRL", "steps": measured, "prompt_tokens_mean": sum(prompt_tokens[n_prompts:]) / len(prompt_tokens[n_prompts:]),
        "load_avg": [0.0, 0.0], "notes": notes}))
    return 0


# ----------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--trl-worker" in argv:
        return trl_worker(argv[argv.index("--trl-worker") + 1])
    spec = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from envs.reasoning_gym.catalog import by_env_id
    from model import hub

    if spec.env_id not in by_env_id():
        raise SystemExit(f"bench_trl: no jointrl domain {spec.env_id} (reasoning-gym dataset {spec.dataset!r}); "
                         "`jointrl envs list` shows the rg-* domains")
    if spec.model not in hub.names():
        raise SystemExit(f"bench_trl: unknown model {spec.model!r}; pullable: {', '.join(hub.names())}")
    ensure_trl_venv()
    model_dir = hub.pull(spec.model)
    plan, limits = replay_prompts(spec, model_dir)
    t0 = time.perf_counter()
    j = run_jointrl(spec, model_dir, plan)
    t1 = time.perf_counter()
    t = run_trl(spec, model_dir, plan, limits)
    t2 = time.perf_counter()
    table = format_table(j, t)
    print(f"\njointrl vs TRL GRPOTrainer: {spec.model} {'bf16 (each side its own mode)' if spec.bf16 else 'fp32'}, {spec.env_id} (one turn, answer tool), "
          f"{spec.prompts} prompts x {spec.generations} samples x <= {spec.max_new_tokens} new tokens, "
          f"lr {spec.lr}, temperature {spec.temperature}; {spec.warmup} warm-up + {spec.steps} measured steps per side "
          f"(whole runs: jointrl {t1 - t0:.0f} s with start-up and evaluation, TRL {t2 - t1:.0f} s)\n")
    print(table)
    out = spec.out_dir() / "results.json"
    out.write_text(json.dumps({"spec": asdict(spec), "jointrl": asdict(j), "trl": asdict(t), "table": table}, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/bench_trl.py's pure parts, without TRL: arguments, the settings both sides get, the answer
TRL's reward reads (against jointrl's real chat codec and rg environment), the reward itself (against
reasoning-gym's `score_answer`), the jointrl metrics it reads, and the side-by-side table.

Real parts: vLLM's hermes parser inside the `hf` codec (on a tiny trained tokenizer with vLLM's chatml
template, which has no tool section, as SmolLM2's has none), the rg domain's `ToolEnv`, the
out-of-process reasoning-gym judge, `rl.config.load_config`.
"""
from __future__ import annotations

import dataclasses
import asyncio
import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests import REPO

SCRIPT = REPO / "scripts" / "bench_trl.py"
ENV_ID = "rg-basic_arithmetic-v0"


def _load():
    spec = importlib.util.spec_from_file_location("bench_trl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["bench_trl"] = mod
    spec.loader.exec_module(mod)
    return mod


b = _load()


# ----------------------------------------------------------------------------- arguments and settings
def test_defaults_are_the_spec_defaults():
    assert b.parse_args([]) == b.BenchSpec()
    s = b.BenchSpec()
    assert (s.prompts, s.generations, s.max_new_tokens, s.steps, s.warmup, s.micro_batch) == (4, 4, 64, 3, 1, 2)


def test_every_flag_reaches_the_spec():
    s = b.parse_args(["--dataset", "chain_sum", "--prompts", "3", "--generations", "5", "--max-new-tokens", "32",
                      "--steps", "2", "--warmup", "0", "--micro-batch", "5", "--temperature", "0.7", "--lr", "3e-6", "--seed", "7",
                      "--model", "smollm2-135m-moe", "--trl-threads", "0", "--jointrl-threads", "2", "--gap-every", "0", "--bf16", "--prefix-sharing", "off",
                      "--out", "/tmp/x"])
    assert s == b.BenchSpec(dataset="chain_sum", prompts=3, generations=5, max_new_tokens=32, steps=2, warmup=0,
                            micro_batch=5, temperature=0.7, lr=3e-6, seed=7, model="smollm2-135m-moe", trl_threads=0,
                            jointrl_threads=2, gap_every=0, bf16=True, prefix_sharing="off", out="/tmp/x")
    assert (s.env_id, s.batch, s.total_steps) == ("rg-chain_sum-v0", 15, 2)
    assert s.out_dir() == Path("/tmp/x") and b.BenchSpec(out="runs/r").out_dir() == REPO / "runs" / "r"


@pytest.mark.parametrize("argv, says", [
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--generations", "1"], "--generations must be >= 2"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--micro-batch", "3"], "--micro-batch must be >= 1 and divide prompts x generations = 16"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr=-1e-6"], "--lr must be > 0"),
    (["--trl-threads", "-2"], "--trl-threads must be >= 0"),
    (["--jointrl-threads", "0"], "--jointrl-threads must be >= 1"),
    (["--gap-every", "-1"], "--gap-every must be >= 0"),
    (["--dataset", "../etc"], "--dataset must be a reasoning-gym dataset name"),
    (["--prefix-sharing", "yes"], "invalid choice: 'yes'"),
    (["--prompts", "two"], "invalid int value"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        b.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


SPEC = b.BenchSpec(dataset="chain_sum", prompts=3, generations=5, max_new_tokens=32, steps=2, warmup=2, jointrl_threads=2,
                   micro_batch=5, temperature=0.7, lr=3e-6, seed=7, gap_every=3)


def test_jointrl_overrides_make_a_valid_run_with_the_shared_settings(tmp_path):
    from rl.config import load_config

    # a shipped shape name stands in for the checkpoint directory (no checkpoint needed to validate)
    cfg = load_config(None, b.jointrl_overrides(SPEC, Path("tiny"), tmp_path / "run"))
    assert cfg.model.arch == "tiny" and cfg.run_dir == str(tmp_path / "run")
    assert cfg.envs.weights == {b.DOMAIN: 1.0} and cfg.envs.env_ids[b.DOMAIN] == "rg-chain_sum-v0"
    assert (cfg.envs.max_turns, cfg.envs.seed, cfg.model.seed) == (1, 7, 7)
    assert (cfg.trainer.tasks_per_step, cfg.algorithm.group_size, cfg.trainer.micro_batch_size) == (3, 5, 5)
    assert (cfg.trainer.steps, cfg.trainer.sft_steps, cfg.trainer.lr) == (4, 0, 3e-6)
    assert (cfg.rollout.max_new_tokens_per_turn, cfg.rollout.temperature, cfg.rollout.top_p) == (32, 0.7, 1.0)
    assert all(v == -1 for v in cfg.rollout.thinking_budgets.values())  # only max_new_tokens caps a turn
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("float32", "float32")
    assert (cfg.algorithm.dynamic_sampling, cfg.algorithm.kl_coef, cfg.trainer.resume) == ("off", 0.0, False)
    assert cfg.logging.samples_per_domain == 15  # every episode's task id is logged, to check the replay
    assert (cfg.trainer.threads_per_rank, cfg.rollout.threads_per_worker) == (SPEC.jointrl_threads,) * 2
    assert cfg.logging.gap_every == 3
    assert cfg.trainer.prefix_sharing == "auto"
    off = load_config(None, b.jointrl_overrides(dataclasses.replace(SPEC, prefix_sharing="off"), Path("tiny"), tmp_path / "run"))
    assert off.trainer.prefix_sharing == "off"
    bf = load_config(None, b.jointrl_overrides(dataclasses.replace(SPEC, bf16=True), Path("tiny"), tmp_path / "run"))
    assert (bf.model.dtype, bf.rollout.dtype, bf.trainer.sync_format) == ("bfloat16", "bfloat16", "bf16")
    assert cfg.trainer.sync_format == "fp32"


def test_trl_gets_the_same_settings_as_jointrl(tmp_path):
    from rl.config import load_config

    cfg = load_config(None, b.jointrl_overrides(SPEC, Path("tiny"), tmp_path / "run"))
    k = b.trl_config_kwargs(SPEC, str(tmp_path / "trl"))
    pairs = {
        "per_device_train_batch_size": cfg.trainer.micro_batch_size,
        "num_generations": cfg.algorithm.group_size,
        "max_completion_length": cfg.rollout.max_new_tokens_per_turn,
        "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
        "learning_rate": cfg.trainer.lr, "weight_decay": cfg.trainer.weight_decay, "max_grad_norm": cfg.trainer.grad_clip,
        "warmup_steps": cfg.trainer.warmup_steps, "max_steps": cfg.trainer.steps, "seed": cfg.envs.seed,
        "beta": cfg.algorithm.kl_coef, "epsilon": cfg.algorithm.clip_low, "epsilon_high": cfg.algorithm.clip_high,
    }
    for key, want in pairs.items():
        assert k[key] == want, key
    # the whole batch generated at once, trained in micro-batches accumulated into one optimiser step, on both sides
    batch = cfg.trainer.tasks_per_step * cfg.algorithm.group_size
    assert k["per_device_train_batch_size"] * k["gradient_accumulation_steps"] == batch == 15
    assert k["steps_per_generation"] == k["gradient_accumulation_steps"] == 3 and k["num_iterations"] == 1
    # jointrl's trainer: torch AdamW with betas (0.9, 0.95) (rl/trainer/policy.py)
    assert (k["adam_beta1"], k["adam_beta2"]) == (0.9, 0.95)
    # per-sequence token means on both sides; fp32, no gradient checkpointing, jointrl's task order
    assert cfg.algorithm.aggregation == "seq_mean_token_mean" and k["loss_type"] == "grpo"
    assert (k["bf16"], k["fp16"], k["gradient_checkpointing"], k["shuffle_dataset"], k["use_cpu"]) == (False, False, False, False, True)
    assert b.trl_config_kwargs(dataclasses.replace(SPEC, bf16=True), str(tmp_path / "trl"))["bf16"] is True


def test_the_trl_venv_takes_the_projects_pins():
    from importlib.metadata import version

    reqs = b.trl_requirements()
    for dist in ("transformers", "datasets", "reasoning-gym"):  # what the project's .venv runs
        assert f"{dist}=={version(dist)}" in reqs
    assert any(r.startswith("trl==") for r in reqs)
    assert b._pyproject_pin("torch") == "torch==2.13.0"
    with pytest.raises(RuntimeError, match="pins no exact version of no-such-package"):
        b._pyproject_pin("no-such-package")


# ----------------------------------------------------------------------------- the answer, vs jointrl's codec + env
def _call(name, args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


REPLIES = {
    "one call": _call("answer", {"text": "42"}),
    "text before the call": "Let me compute: 6*7.\n" + _call("answer", {"text": "42"}),
    "unclosed last call": 'So <tool_call>{"name": "answer", "arguments": {"text": "-7"}}',
    "another tool first": _call("think", {"x": 1}) + "\n" + _call("answer", {"text": "3"}),
    "two answers: the first counts": _call("answer", {"text": "1"}) + _call("answer", {"text": "2"}),
    "empty answer": _call("answer", {"text": ""}),
    "unicode": _call("answer", {"text": "\u221a2 \u2248 1.41"}),
    "one block not JSON: no call at all": _call("answer", {"text": "5"}) + "<tool_call>{oops</tool_call>",
    "no arguments key": '<tool_call>{"name": "answer"}</tool_call>',
    "extra argument": _call("answer", {"text": "5", "why": "because"}),
    "text not a string": _call("answer", {"text": 5}),
    "arguments a string": _call("answer", "5"),
    "name not a string": '<tool_call>{"name": 5, "arguments": {"text": "5"}}</tool_call>',
    "answer tags only (tool mode)": "<answer>5</answer>",
    "plain text": "The answer is 5.",
    "the answer as the ninth call": "".join(_call("think", {}) for _ in range(8)) + _call("answer", {"text": "9"}),
    "the answer as the eighth call": "".join(_call("think", {}) for _ in range(7)) + _call("answer", {"text": "8"}),
}


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    from tests.rl.rollout.test_codec import _tiny_checkpoint, _vllm_chatml
    from rl.rollout.codec import make_codec

    d = _tiny_checkpoint(tmp_path_factory.mktemp("chatml"), _vllm_chatml())
    return make_codec("hf", d, tool_parser="hermes")


@pytest.fixture(scope="module")
def task():
    import envs
    from jointrl.records import Task

    return Task.from_row(envs.tasks(ENV_ID, "train", seed=0, n=1)[0])


def _jointrl_answer(codec, task, reply: str) -> str | None:
    """The answer the rg domain records when the engine generated `reply` then the turn's end token."""
    import envs

    ids = codec.tokenizer.encode(reply, add_special_tokens=False)
    assert codec.tokenizer.decode(ids, skip_special_tokens=False) == reply
    env = envs.make(ENV_ID)
    try:
        _, tools = asyncio.run(env.reset(task))
        parsed = codec.parse(ids + [codec.end_token_id], 0, tools)
        asyncio.run(env.step(parsed.message, parse_errors=parsed.call_errors))
        return env.domain.given_answer(())
    finally:
        env.close()


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_answer_of_reads_what_jointrl_records(codec, task, case):
    import envs

    env = envs.make(ENV_ID)
    limits = {"max_calls": env.max_calls_per_turn, "max_arg_chars": task.limits.max_arg_chars}
    env.close()
    assert b.answer_of(REPLIES[case], **limits) == _jointrl_answer(codec, task, REPLIES[case])


def test_answer_of_cases_cover_both_outcomes():
    got = {c: b.answer_of(r) for c, r in REPLIES.items()}
    assert got["one call"] == "42" and got["unclosed last call"] == "-7" and got["another tool first"] == "3"
    assert got["two answers: the first counts"] == "1" and got["the answer as the eighth call"] == "8"
    assert got["one block not JSON: no call at all"] is None and got["the answer as the ninth call"] is None
    assert b.answer_of(_call("answer", {"text": "x" * 100}), max_arg_chars=50) is None  # over the argument cap


# ----------------------------------------------------------------------------- the reward vs score_answer
def test_reward_equals_score_answer_on_the_reference_and_a_wrong_answer(codec, task):
    import reasoning_gym

    from envs.reasoning_gym.judge import ItemRef, Judge
    from envs.reasoning_gym.judge_worker import decode_entry

    tok = codec.tokenizer
    p = task.private
    entry = decode_entry(p["entry"])
    ds = reasoning_gym.create_dataset(p["dataset"], seed=p["seed"], size=p["size"])
    ref = str(p["reference"])
    wrong = str(int(float(ref)) + 1) if ref.lstrip("-").isdigit() else ref + "0"
    judge = Judge()
    try:
        scorer = b.CompletionScorer(decode=lambda ids: tok.decode(ids, skip_special_tokens=False), eos_id=codec.end_token_id,
                                    judge=judge, item_ref=ItemRef, max_calls=8, max_arg_chars=65_536)
        texts = [_call("answer", {"text": ref}), _call("answer", {"text": wrong}), "no call", _call("answer", {"text": " "})]
        ids = [tok.encode(t, add_special_tokens=False) + [codec.end_token_id] for t in texts]
        ids[2] = ids[2][:-1]  # a reply cut at the length cap: no closing eos
        n = len(texts)
        got = scorer(ids, [p["dataset"]] * n, [p["seed"]] * n, [p["size"]] * n, [p["entry"]] * n)
    finally:
        judge.close()
    assert got[0] == float(ds.score_answer(ref, entry)) == 1.0
    assert got[1] == float(ds.score_answer(wrong, entry)) < 1.0
    assert got[2:] == [0.0, 0.0]  # no answer / an empty one: 0 without the scorer


# ----------------------------------------------------------------------------- metrics and the table
def _row(step: int, step_s: float, n: int = 16, resp: float = 40.0) -> dict:
    return {"step": step, "time/step_s": step_s, "time/rollout_generate_s": 1.0, "time/rollout_tools_s": 0.25,
            "time/rollout_grade_s": 0.25, "time/train_s": 3.0, "time/sync_s": 0.5, f"episodes/count/{b.DOMAIN}": n,
            f"tokens/response_mean/{b.DOMAIN}": resp, "reward/mean/all": 0.25}


def test_jointrl_steps_drop_warmup_and_read_the_breakdown():
    rows = [_row(2, 9.0), {"step": 0, "eval/success": 0.0}, _row(0, 99.0), _row(1, 6.0, resp=10.5)]
    steps = b.jointrl_steps(rows, warmup=1)
    assert [s.step_s for s in steps] == [6.0, 9.0]
    s = steps[0]
    assert (s.generate_s, s.grade_s, s.train_s, s.sync_s, s.samples, s.generated_tokens) == (1.0, 0.5, 3.0, 0.5, 16, 168)
    assert s.other_s == pytest.approx(1.0)


def _side(name: str, step_times, samples=16, tokens=640, gen=1.0) -> "b.SideResult":
    steps = tuple(b.StepRecord(step_s=t, generate_s=gen, grade_s=0.1, train_s=t / 2, sync_s=0.0, samples=samples,
                               generated_tokens=tokens, reward_mean=0.5) for t in step_times)
    return b.SideResult(name=name, steps=steps, prompt_tokens_mean=266.0, load_avg=(3.0, 4.0))


def test_side_figures_are_totals_over_time():
    s = _side("x", [2.0, 6.0], samples=16, tokens=640)
    assert s.step_s == 4.0
    assert s.samples_per_s == 32 / 8.0 and s.tokens_per_s == 1280 / 8.0 and s.completion_mean == 40.0
    assert s.generate_samples_per_s == 32 / 2.0 and s.part_mean("train") == 2.0
    with pytest.raises(ValueError, match="no measured steps"):
        b.SideResult(name="y", steps=(), prompt_tokens_mean=1.0, load_avg=(0.0, 0.0))
    assert b.SideResult.from_json(json.loads(json.dumps(__import__("dataclasses").asdict(s)))) == s


def test_table_shows_ratios_and_the_target_verdict():
    j, t = _side("jointrl", [2.0, 2.0], gen=0.5), _side("TRL", [10.0, 10.0], gen=8.0)
    text = b.format_table(j, t)
    line = next(ln for ln in text.splitlines() if ln.startswith("| generated samples/s"))
    assert [c.strip() for c in line.strip("|").split("|")] == ["generated samples/s", "8.00", "1.60", "5.00x"]
    step = next(ln for ln in text.splitlines() if ln.startswith("| step time (s)"))
    assert step.rstrip(" |").endswith("0.20x")
    assert "5.00x (met)" in text
    gen = next(ln for ln in text.splitlines() if ln.startswith("| samples/s of generation alone"))
    assert [c.strip() for c in gen.strip("|").split("|")][1:] == ["32.00", "2.00", "16.00x"]
    assert "jointrl  2.00 = generate 0.50 + grade 0.10 + train 1.00 + sync 0.00 + other 0.40" in text
    slow = b.format_table(_side("jointrl", [10.0]), _side("TRL", [15.0]))
    assert "1.50x (missed)" in slow
    assert math.isnan(b.SideResult(name="z", steps=(b.StepRecord(1.0, 0.0, 0.0, 0.0, 0.0, 1, 1, 0.0),),
                                   prompt_tokens_mean=1.0, load_avg=(0.0, 0.0)).generate_samples_per_s)

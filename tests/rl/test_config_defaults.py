"""One default per config key: each section (rl/config.py composes them) declares its keys' defaults once, and
every record that carries a key elsewhere (`TrainerSpec`, `CriticSpec`, `LoraSpec`, `RLObjective`,
`EngineConfig`, `LoopSettings`, `DomainSampler`, `ServeSettings`) takes its default from the section's field
instead of writing the value again.

Checked two ways: the defaults agree (every section built with its defaults against each mirror's), and
none of the mirrored fields declares a literal default in its class's source (a second declaration, which
could drift from the section's). A mirror field with the same name as a key of a section it mirrors and a
default of its own must be in `OWN_DEFAULT` with the reason it is a different setting.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import pytest

T, M, A, L, R, E = "trainer", "model", "algorithm", "trainer.lora", "rollout", "envs"

# mirror class -> {its field: (section, section key)}
MIRRORED: dict[str, dict[str, tuple[str, str]]] = {
    "rl.trainer.policy.TrainerSpec": {
        **{f: (T, f) for f in ("zero_stage", "lr", "weight_decay", "grad_clip", "warmup_steps", "micro_batch_size", "frozen_layers",
                               "prefix_sharing", "logprob_tile_tokens", "activation_checkpointing", "max_tokens_per_micro_batch")},
        **{f: (M, f) for f in ("dtype", "seed", "routing_replay", "freeze_router_bias")}},
    "rl.trainer.critic.CriticSpec": {
        "lr": (T, "critic_lr"), "value_clip": (A, "value_clip"), "dtype": (M, "dtype"),
        **{f: (T, f) for f in ("weight_decay", "grad_clip", "zero_stage", "micro_batch_size", "prefix_sharing",
                               "activation_checkpointing", "max_tokens_per_micro_batch")}},
    "rl.trainer.lora.LoraSpec": {f: (L, f) for f in ("rank", "alpha", "dropout", "targets", "sync")},
    "rl.objective.RLObjective": {
        **{f: (A, f) for f in ("policy_loss", "clip_low", "clip_high", "tis_cap", "kl_coef", "kl_estimator")},
        "router_aux_coef": (M, "router_aux_loss_coef"), "router_z_coef": (M, "router_z_loss_coef")},
    "rl.rollout.engine.EngineConfig": {f: (R, f) for f in ("max_model_len", "kv_cache_gib", "gpu_memory_utilization", "enforce_eager",
                                                           "seeded_requests", "tensor_parallel_size", "max_images_per_prompt")},
    "rl.rollout.agent_loop.LoopSettings": {
        **{f: (R, f) for f in ("max_model_len", "max_new_tokens_per_turn", "temperature", "top_p", "thinking_budgets")},
        "per_request_seed": (R, "seeded_requests")},
    "rl.sampler.DomainSampler": {
        "seed": (E, "seed"), "adaptive": (E, "adaptive_weights"), "min_weight": (E, "min_weight"), "rule": (E, "sampler_rule"),
        "level": (E, "sampler_level"), "dump_c": (E, "dump_c"), "dump_temperature": (E, "dump_temperature")},
    "rl.serve.settings.ServeSettings": {
        **{f: (R, f) for f in ("max_model_len", "dtype", "kv_cache_gib", "enforce_eager", "thinking_budgets")},
        **{f: (M, f) for f in ("seed", "chat_codec", "tool_parser", "reasoning_parser")}},
}

# mirror fields named like a key of a section the class mirrors, but a setting of their own
OWN_DEFAULT: dict[str, str] = {
    "rl.rollout.engine.EngineConfig.dtype": "the engine's precision when built without a run (tests, benchmarks); a run passes "
                                            "rollout.dtype, whose 'auto' the engine does not take",
    "rl.rollout.engine.EngineConfig.seed": "the engine's sampling seed; a run passes model.seed",
    "rl.rollout.agent_loop.LoopSettings.context": "a ContextSettings built from the rollout.context* keys (rl/setup.py); "
                                                  "its own default is the `full` strategy, rollout.context's",
    "rl.trainer.policy.TrainerSpec.lora": "a LoraSpec, whose fields take trainer.lora's defaults (checked as its own mirror)",
}


def _class(path: str):
    mod, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


def _section_default(section: str, key: str):
    from rl.config import RunConfig

    obj = RunConfig()
    for part in section.split("."):
        obj = getattr(obj, part)
    return getattr(obj, key)


def _field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("mirror", sorted(MIRRORED))
def test_each_mirror_defaults_to_its_sections_values(mirror):
    fields = {f.name: f for f in dataclasses.fields(_class(mirror))}
    for name, (section, key) in MIRRORED[mirror].items():
        want = _section_default(section, key)
        got = _field_default(fields[name])
        assert got == want or (isinstance(got, tuple) and list(got) == want), f"{mirror}.{name}: {got!r} but {section}.{key}: {want!r}"


def _literal(node: ast.AST) -> bool:
    """A default written as a value (not taken from a section): a constant, -constant, or a container of them."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(_literal(v) for v in node.values)
    if isinstance(node, ast.Lambda):
        return _literal(node.body)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "field":  # field(default=...) / field(default_factory=...)
        return any(_literal(k.value) for k in node.keywords if k.arg in ("default", "default_factory"))
    return False


def _declared_defaults(cls) -> dict[str, ast.AST]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    return {s.target.id: s.value for s in body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value}


@pytest.mark.parametrize("mirror", sorted(MIRRORED))
def test_no_mirror_declares_a_sections_default_again(mirror):
    from rl.config import RunConfig

    cls = _class(mirror)
    declared = _declared_defaults(cls)
    twice = [f"{n} = {ast.unparse(declared[n])}" for n in MIRRORED[mirror] if n in declared and _literal(declared[n])]
    assert not twice, f"{mirror} declares section defaults again (take them from the section's field): {twice}"
    # a field named like a key of a section this class mirrors is that key, unless it says why not
    cfg = RunConfig()
    sections = {s for s, _ in MIRRORED[mirror].values()}
    keys = set()
    for s in sections:
        obj = cfg
        for part in s.split("."):
            obj = getattr(obj, part)
        keys |= {f.name for f in dataclasses.fields(obj)}
    unlisted = sorted(n for n in declared if n in keys and _literal(declared[n]) and n not in MIRRORED[mirror]
                      and f"{mirror}.{n}" not in OWN_DEFAULT)
    assert not unlisted, f"{mirror}: fields named like section keys with a default of their own, not explained: {unlisted}"


def test_max_model_len_is_declared_once():
    """The headline case: `max_model_len = 2048` was written in five places."""
    import re

    from tests import REPO

    hits = [f"{p.relative_to(REPO)}:{i + 1}" for p in (REPO / "rl").rglob("*.py")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()) if re.match(r"\s+max_model_len: int = \d", line)]
    assert len(hits) == 1 and hits[0].startswith("rl/rollout/config.py:"), hits


# the run config's sections, each declared by the component that reads it (rl/config.py only composes them)
OWNERS = {"model": "rl.model_config", "rollout": "rl.rollout.config", "envs": "rl.tasks", "algorithm": "rl.objective",
          "trainer": "rl.trainer.config", "eval": "rl.eval_config", "logging": "rl.observe.config"}


def test_each_section_is_declared_by_its_component():
    from rl import config
    from rl.config import RunConfig

    cfg = RunConfig()
    sections = {f.name: type(getattr(cfg, f.name)) for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    assert {n: c.__module__ for n, c in sections.items()} == OWNERS
    for cls in sections.values():
        assert getattr(config, cls.__name__) is cls  # re-exported: `from rl.config import EvalSection` keeps working
    here = [n for n, obj in vars(config).items() if dataclasses.is_dataclass(obj) and obj.__module__ == "rl.config"]
    assert here == ["RunConfig"], here


@pytest.mark.parametrize("override, needle", [
    ("algorithm.group_size=0", "config key 'algorithm.group_size': value 0 must be > 0"),
    ("algorithm.lam=1.5", "config keys 'algorithm.gamma' / 'algorithm.lam': 1.0 / 1.5 must each be in [0, 1]"),
    ("algorithm.kl_in_reward=true", "config key 'algorithm.kl_in_reward': needs algorithm.kl_coef > 0"),
    ("eval.samples=0", "config key 'eval.samples': value 0 must be > 0"),
    ("eval.samples=2", "config key 'eval.samples': more than one sample per task needs eval.temperature > 0"),
    ("eval.temperature=-1", "config key 'eval.temperature': value -1.0 must be >= 0"),
    ("model.chat_codec=vllm", "config key 'model.chat_codec': value 'vllm' is not allowed"),
    ("model.arch=tinyy", "config key 'model.arch': 'tinyy' is not a model; did you mean 'tiny'?"),
    ("model.reference=nowhere", "config key 'model.reference': 'nowhere' is neither 'initial' nor a checkpoint"),
    ("envs.default_tier.terminal=mid", "config key 'envs.default_tier.terminal': value 'mid' is not allowed; allowed values: 'low'"),
    ("envs.dump_temperature=0", "config key 'envs.dump_temperature': value 0.0 must be > 0"),
    ("envs.env_ids.terminal=terminl-v0", "config key 'envs.env_ids.terminal': unknown environment id 'terminl-v0'; did you mean"),
    ("trainer.lora.rank=600", "config key 'trainer.lora.rank': value 600 is not allowed; allowed values: 0 (no LoRA) or 1..512"),
])
def test_moved_sections_check_their_keys(override, needle):
    """The algorithm, eval, model, envs and trainer.lora checks, run where their section is declared, keep their messages."""
    from rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert needle in str(ei.value), str(ei.value)


def test_the_literal_check_can_fail():
    src = "class X:\n    a: int = 3\n    b: int = Section.b\n    c: dict = field(default_factory=lambda: {'x': 1})\n"
    tree = ast.parse(src).body[0].body
    assert [_literal(s.value) for s in tree] == [True, False, True]

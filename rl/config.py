"""The run configuration: one typed tree, loaded from YAML, overridden by dotted keys.

Each section is a dataclass declared by the component that reads it (model: rl/model_config.py, rollout:
rl/rollout/config.py, envs: rl/tasks.py, algorithm: rl/objective.py, trainer: rl/trainer/config.py, eval:
rl/eval_config.py, logging: rl/observe/config.py), whose field defaults are the single source of defaults,
whose field comments document the meaning, and whose own checks live beside it. This module composes them
into `RunConfig` (and re-exports them). `load_config(path, overrides)` validates everything before anything
starts: an unknown key (with the nearest valid key suggested), a value of the wrong type, a value outside
its allowed set, or a combination across sections that cannot run raises `ConfigError` naming the key, the
bad value and what is allowed. This module starts nothing and pulls nothing: start-up pulls a pullable model
named by `model.arch` / `model.reference` (`pull_models`, which checks the pulled weights again).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from jointrl.paths import REPO_ROOT, cache_root
from rl.errors import ConfigError  # noqa: F401  (re-exported: callers import it from here)
from rl.rollout.tiers import TIERS  # light: the names of jointrl.records.ThinkingTier
# Sections owned by their components, composed here (and re-exported: callers import them from here too).
from rl.eval_config import EvalSection  # noqa: F401
from rl.model_config import ModelSection  # noqa: F401
from rl.model_config import check_chat_codec, check_family, check_names, check_reference, resolve_model_paths
from rl.objective import AlgorithmSection  # noqa: F401
from rl.observe.config import LoggingSection  # noqa: F401
from rl.rollout.config import RolloutSection  # noqa: F401
from rl.tasks import EnvsSection  # noqa: F401
from rl.tasks import check_default_tiers, check_env_ids, check_sampler, check_weights
from rl.trainer.config import LoraSection, TrainerSection  # noqa: F401
from rl.trainer.config import check_lora

CONFIG_DIR = REPO_ROOT / "configs"


class _Loader(yaml.SafeLoader):
    """YAML 1.2-style booleans: only true/false. (YAML 1.1 reads `off`, `on`, `yes`, `no` as
    booleans, which would turn `dynamic_sampling: off` into False.)"""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", __import__("re").compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


# ----------------------------------------------------------------------------- the run
@dataclass
class RunConfig:
    """The whole run. `run_dir` holds checkpoints, metrics and every cache (see rl.paths)."""

    name: str = "run"
    run_dir: str = "runs/${name}"
    cache_dir: str = ".cache"  # vLLM compile cache, torch extensions, Ray temp, HF cache live here
    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    envs: EnvsSection = field(default_factory=EnvsSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def resolved_run_dir(self) -> Path:
        p = Path(self.run_dir.replace("${name}", self.name))
        return p if p.is_absolute() else REPO_ROOT / p

    def resolved_cache_dir(self) -> Path:
        return cache_root(self.cache_dir)


# ----------------------------------------------------------------------------- validation
def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to floats). Raise ConfigError."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        # `True == 1` in Python: compare types too, so `zero_stage=true` is refused.
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"config key '{key}': value {value!r} is not allowed; allowed values: {', '.join(repr(a) for a in allowed)}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            if arm is type(None):  # the null arm takes only null (other values fall through to the error below)
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, arm)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"config key '{key}': value {value!r} does not match {tp}")
    if origin is dict:
        kt, vt = get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(f"{key}.{k}", k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}
    if origin is list:
        (it,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, it) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': expected a number (float), got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}': expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}': expected a string, got {type(value).__name__} {value!r}")
        return value
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            full = [f"{prefix}{n}" for n in names]
            near = difflib.get_close_matches(key, full, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{key}'{hint} (valid keys here: {', '.join(full)})")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(f"config key '{key}': expected a section (mapping), got {v!r}")
            kwargs[k] = _build(tp, v, f"{key}.")
        else:
            kwargs[k] = _coerce(key, v, tp)
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Dotted-override values are YAML scalars: `1e-5`, `true`, `[a, b]`, `{swe: 0.5}`."""
    value = _yaml(text)
    # YAML 1.1 reads '1e-5' as a string; accept it as a float.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") and not value.isalpha() else value
        except ValueError:
            return value
    return value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, defaults: dict[str, Any]) -> None:
    """Set `a.b.c=value` in the raw tree. A missing level is seeded from the defaults, so
    `envs.weights.swe=0.5` adds a domain to the default mapping instead of replacing it."""
    parts = dotted.split(".")
    node, dnode = tree, defaults
    for p in parts[:-1]:
        dsub = dnode.get(p) if isinstance(dnode, dict) else None
        if p not in node:
            node[p] = copy.deepcopy(dsub) if isinstance(dsub, dict) else {}
        nxt = node[p]
        if not isinstance(nxt, dict):
            raise ConfigError(f"config override '{dotted}': '{p}' is not a section")
        node, dnode = nxt, dsub if isinstance(dsub, dict) else {}
    node[parts[-1]] = value


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """`config file F, line L, column C: problem` (and the offending line), from a YAML parser error."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    if mark is None:
        return f"config file {path}: not valid YAML: {problem}"
    lines = path.read_text().splitlines()
    shown = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^" if mark.line < len(lines) else ""
    return f"config file {path}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {problem}{shown}"


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML run config (or the defaults) and apply `key.sub=value` overrides; validate all of it.
    It pulls nothing: a pullable model (or a URL of exported weights) in `model.arch` / `model.reference`
    already on this machine reads as its directory, one not here keeps its name until start-up pulls it
    (`pull_models`)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists() and (CONFIG_DIR / p).exists():
            p = CONFIG_DIR / p
        if not p.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = _yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(p, e)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        data = loaded
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"config override '{ov}' must look like key.sub=value")
        k, v = ov.split("=", 1)
        _set_dotted(data, k.strip(), _parse_scalar(v), dataclasses.asdict(RunConfig()))
    cfg = resolve_pullable(_build(RunConfig, data, ""), pull=False)
    validate(cfg)
    return cfg


def resolve_pullable(cfg: RunConfig, *, pull: bool = True) -> RunConfig:
    """`cfg` with `model.arch` and `model.reference` read as checkpoint directories (rl/model_config.py
    `resolve_model_paths`): a pullable model or a URL of exported weights is pulled first (`pull=False`: only one
    already here is read, else the name is kept), a run's checkpoint directory becomes its `hf/`."""
    return dataclasses.replace(cfg, model=resolve_model_paths(cfg.model, pull=pull))


def pull_models(cfg: RunConfig) -> RunConfig:
    """Start-up's pull (rl/setup.py `start_run`, `jointrl train`): `resolve_pullable`, then, where a model was
    pulled, the checks again on its weights (its family, its chat codec), so a pulled model that cannot run is
    refused naming the key before anything starts. A no-op once both keys are directories."""
    out = resolve_pullable(cfg, pull=True)
    if out.model == cfg.model:
        return cfg
    validate(out)
    return out


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that types alone cannot express."""
    _validate_gpu_paths(cfg)
    check_chat_codec(cfg.model)
    check_family(cfg.model)
    check_weights(cfg.envs)
    _validate_context(cfg)
    from rl.trainer.ulysses import run_config_problem  # trainer.sequence_parallel_size against the run

    if problem := run_config_problem(cfg):
        raise ConfigError(problem)
    allowed_tiers = ", ".join(repr(t) for t in TIERS)
    for tier, n in cfg.rollout.thinking_budgets.items():
        if tier not in TIERS:
            raise ConfigError(f"config key 'rollout.thinking_budgets.{tier}': unknown tier; allowed: {allowed_tiers}")
    # every tier a task can carry needs a budget, so rl.rollout.tiers.TierError cannot stop a run mid-rollout
    missing = [t for t in TIERS if t not in cfg.rollout.thinking_budgets]
    if missing:
        raise ConfigError(f"config key 'rollout.thinking_budgets': no budget for tier(s) {', '.join(repr(t) for t in missing)}; "
                          f"every tier needs one (tiers: {allowed_tiers}; -1 = no cap)")
    check_default_tiers(cfg.envs)
    positive = {
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size,
        "trainer.tasks_per_step": cfg.trainer.tasks_per_step,
        "rollout.num_workers": cfg.rollout.num_workers,
        "trainer.num_workers": cfg.trainer.num_workers,
        "trainer.cpus_per_rank": cfg.trainer.cpus_per_rank,
        "trainer.threads_per_rank": cfg.trainer.threads_per_rank,
        "rollout.threads_per_worker": cfg.rollout.threads_per_worker,
        "rollout.max_model_len": cfg.rollout.max_model_len,
    }
    for k, v in positive.items():
        if v <= 0:
            raise ConfigError(f"config key '{k}': value {v} must be > 0")
    check_sampler(cfg.envs)
    for k, v in {"trainer.sft_tasks_per_domain": cfg.trainer.sft_tasks_per_domain,
                 "trainer.frozen_layers": cfg.trainer.frozen_layers,
                 "trainer.logprob_tile_tokens": cfg.trainer.logprob_tile_tokens,
                 "trainer.max_tokens_per_micro_batch": cfg.trainer.max_tokens_per_micro_batch}.items():
        if v < 0:
            raise ConfigError(f"config key '{k}': value {v} must be >= 0")
    if cfg.trainer.sft_data and not Path(cfg.trainer.sft_data).is_file():
        raise ConfigError(f"config key 'trainer.sft_data': {cfg.trainer.sft_data!r} is not a file (a JSONL of "
                          "demonstrations, rl/sft.py; \"\" = the domains' reference solutions)")
    if cfg.trainer.sft_data and cfg.trainer.sft_tasks_per_domain:
        raise ConfigError("config keys 'trainer.sft_data' and 'trainer.sft_tasks_per_domain': set one of them (the file "
                          f"decides its tasks); got {cfg.trainer.sft_data!r} and {cfg.trainer.sft_tasks_per_domain}")
    from jointrl.limits import MAX_IMAGES_PER_PROMPT
    from rl.rollout import codec

    if not 0 <= cfg.rollout.max_images_per_prompt <= MAX_IMAGES_PER_PROMPT:
        raise ConfigError(f"config key 'rollout.max_images_per_prompt': value {cfg.rollout.max_images_per_prompt} must be "
                          f"in [0, {MAX_IMAGES_PER_PROMPT}]")
    if cfg.rollout.max_images_per_prompt and codec.resolve_codec_name(cfg.model.chat_codec, cfg.model.arch) != "jointrl":
        raise ConfigError("config key 'rollout.max_images_per_prompt': images need the jointrl chat codec (the only one "
                          f"that places image placeholders); model.chat_codec={cfg.model.chat_codec!r} resolves otherwise")
    if cfg.trainer.max_staleness < 1:
        raise ConfigError(f"config key 'trainer.max_staleness': value {cfg.trainer.max_staleness} must be >= 1")
    if cfg.trainer.gpus_per_rank < 0:
        raise ConfigError(f"config key 'trainer.gpus_per_rank': value {cfg.trainer.gpus_per_rank} must be >= 0")
    check_names(cfg.model)
    check_env_ids(cfg.envs)
    check_reference(cfg.model)
    check_lora(cfg.trainer.lora, cfg.trainer.sync_transport)
    if cfg.trainer.lr <= 0:
        raise ConfigError(f"config key 'trainer.lr': value {cfg.trainer.lr} must be > 0")
    for key, name in (("trainer.node_resource", cfg.trainer.node_resource), ("rollout.node_resource", cfg.rollout.node_resource)):
        problem = node_resource_problem(name)
        if problem:
            raise ConfigError(f"config key '{key}': {name!r} {problem}")


# Resources Ray counts on every node: they cannot mark chosen nodes, and a NODE_RESOURCE_UNIT of them
# would be taken out of the CPU / memory accounting. (`node:<ip>` and `accelerator_type:<type>`,
# which Ray sets per node, are allowed: they pin a role to that node or node type.)
_COUNTED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
NODE_RESOURCE_UNIT = 0.001  # how much of a `node_resource` each rank / worker takes (Ray's precision is 1e-4)


def node_resource_problem(name: str) -> str:
    """Why `name` cannot be a `*.node_resource` (a Ray resource marking the nodes a role may use), or "" if it can."""
    if name == "":
        return ""
    if any(c.isspace() for c in name):
        return "must not contain whitespace"
    if name in _COUNTED_RESOURCES:
        return ("is a resource Ray counts on every node; name a custom resource that "
                "`ray start --resources '{\"NAME\": 1}'` gives the chosen nodes")
    return ""


def _validate_context(cfg: RunConfig) -> None:
    """rollout.context* and rollout.partial: registered strategy names, sizes that leave room for a turn."""
    from rl.rollout.context import strategy_names

    r = cfg.rollout
    names = strategy_names()
    for key, name in [("rollout.context", r.context)] + [(f"rollout.context_domains.{d}", n) for d, n in r.context_domains.items()]:
        if name not in names:
            raise ConfigError(f"config key '{key}': {name!r} is not a context strategy; allowed values: {', '.join(map(repr, names))}")
    for d in r.context_domains:
        if d not in cfg.envs.env_ids:
            raise ConfigError(f"config key 'rollout.context_domains.{d}': unknown domain; known: {', '.join(sorted(cfg.envs.env_ids))}")
    if r.context_budget_tokens < 0 or r.context_budget_tokens > r.max_model_len:
        raise ConfigError(f"config key 'rollout.context_budget_tokens': {r.context_budget_tokens} must be in [0, rollout.max_model_len="
                          f"{r.max_model_len}] (0: the default budget)")
    if r.context_keep_turns < 0:
        raise ConfigError(f"config key 'rollout.context_keep_turns': {r.context_keep_turns} must be >= 0")
    if r.step_token_budget < 0:
        raise ConfigError(f"config key 'rollout.step_token_budget': {r.step_token_budget} must be >= 0 (0 = off)")
    seconds = r.step_time_budget_s or 0.0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise ConfigError(f"config key 'rollout.step_time_budget_s': {r.step_time_budget_s} is not allowed; allowed values: "
                          "null or 0 (off), or a finite number of seconds > 0")
    if seconds > 0 and r.partial != "on":
        raise ConfigError(f"config key 'rollout.step_time_budget_s': {seconds} is read only with rollout.partial: on "
                          f"(got {r.partial!r}); set rollout.partial=on or leave the key at null / 0")
    if r.partial == "on" and r.step_token_budget <= 0 and seconds <= 0:
        raise ConfigError("config key 'rollout.step_token_budget': partial rollouts (rollout.partial: on) need a budget: "
                          f"rollout.step_token_budget > 0 (generated tokens per step, got {r.step_token_budget}) or "
                          f"rollout.step_time_budget_s > 0 (seconds of generation per step, got {r.step_time_budget_s}); "
                          "with both, whichever is spent first ends the step's generation")


def _whole_gpus(n: float) -> bool:
    return n >= 1 and float(n).is_integer()


def _validate_gpu_paths(cfg: RunConfig) -> None:
    """GPU rollout, tensor parallelism and NCCL sync (nothing here needs a GPU to check; the start-up
    refuses a cluster without the GPUs asked for, rl/placement.py)."""
    r, t = cfg.rollout, cfg.trainer
    if r.gpus_per_worker < 0:
        raise ConfigError(f"config key 'rollout.gpus_per_worker': value {r.gpus_per_worker} must be >= 0")
    if r.tensor_parallel_size < 1:
        raise ConfigError(f"config key 'rollout.tensor_parallel_size': value {r.tensor_parallel_size} must be >= 1")
    if r.tensor_parallel_size > 1 and r.gpus_per_worker == 0:
        raise ConfigError(f"config key 'rollout.tensor_parallel_size': {r.tensor_parallel_size} needs GPU rollout workers; "
                          "on CPU it must be 1 (vLLM's CPU build runs one engine process). For tensor parallelism set "
                          f"rollout.gpus_per_worker={r.tensor_parallel_size}")
    if r.tensor_parallel_size > 1 and r.gpus_per_worker != r.tensor_parallel_size:
        raise ConfigError(f"config key 'rollout.gpus_per_worker': {r.gpus_per_worker} with rollout.tensor_parallel_size="
                          f"{r.tensor_parallel_size}: each worker needs one whole GPU per TP rank "
                          f"(set rollout.gpus_per_worker={r.tensor_parallel_size})")
    if t.sync_transport == "nccl":
        if not (_whole_gpus(t.gpus_per_rank) and _whole_gpus(r.gpus_per_worker)):
            raise ConfigError("config key 'trainer.sync_transport': 'nccl' is GPU only and needs the trainer ranks and every "
                              "rollout worker on GPUs of their own: trainer.gpus_per_rank and rollout.gpus_per_worker must be "
                              f"whole numbers >= 1 (got {t.gpus_per_rank} and {r.gpus_per_worker}; NCCL refuses two ranks on "
                              "one GPU). On CPU, or with roles sharing a GPU, use 'auto', 'shm' or 'object_store'")
        if t.sync_format == "mxfp4":
            raise ConfigError("config key 'trainer.sync_format': 'mxfp4' is not supported with trainer.sync_transport=nccl "
                              "(the engine would have to dequantize); use 'fp32' or 'bf16'")


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)

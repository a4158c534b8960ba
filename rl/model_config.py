"""The `model` section of the run config: which policy to train, its precision, router terms and chat format.

Declared here, once, with every key's default; rl/config.py composes it into RunConfig (YAML, dotted
overrides, coercion). The trainer's specs, the objective's router coefficients and `jointrl serve`'s
settings take their defaults from these fields.

Also here: the section's own checks (`check_*`, each raising `ConfigError` naming the key) and
`resolve_model_paths`, which reads `model.arch` / `model.reference` with the one model-argument resolver
(rl/model_arg.py). What this module does not do: build or load a model. It pulls one only when
`resolve_model_paths(..., pull=True)` is called, which start-up does (rl/config.py `pull_models`, called by
rl/setup.py `start_run` and `jointrl train`), never the config loader.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jointrl.paths import REPO_ROOT
from rl.errors import ConfigError

SHIPPED_DIR = REPO_ROOT / "configs" / "model"  # configs/model/<name>.json: the shipped shapes


@dataclass
class ModelSection:
    """Which policy to train."""

    # a shipped model config (configs/model/<name>.json: random weights), a pullable pretrained model by name
    # (`jointrl models list`: pulled at start-up, cached, then read from its directory), or a HF checkpoint dir
    arch: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"  # trainer dtype
    seed: int = 0
    router_aux_loss_coef: float = 0.001  # small during RL (public practice); always logged
    router_z_loss_coef: float = 0.0
    freeze_router_bias: bool = True  # aux-loss-free bias frozen during RL
    routing_replay: Literal["auto", "r3", "r2", "off"] = "auto"  # auto: R3 if the engine reports routes, else R2
    # The KL reference (read when algorithm.kl_coef > 0 or algorithm.kl_in_reward): "initial" freezes
    # the policy as RL starts (after any SFT warm start; saved in the run dir, so resumes reuse it),
    # or a path to a HF checkpoint dir of the same architecture.
    reference: str = "initial"
    # The chat codec (rl/rollout/codec): "jointrl" (model/chat.py's format), "hf" (the checkpoint's own
    # chat_template, parsed by vLLM's parsers), or "auto": jointrl for a shipped shape or a checkpoint with
    # the shipped tokenizer, hf for a checkpoint with a chat template of its own.
    chat_codec: str = "auto"
    # hf codec: vLLM's tool parser by its registered name (hermes, qwen3_coder, openai = harmony/gpt-oss,
    # deepseek_v3, glm45, ...); hermes also reads the tool prompt given to templates without a tool section.
    tool_parser: str = "hermes"
    # hf codec: vLLM's reasoning parser by name (qwen3, deepseek_r1, openai_gptoss, ...); "" = the model has
    # no reasoning format, and the thinking tiers only cap each turn's generated tokens.
    reasoning_parser: str = ""


def _hub():
    """model/hub.py's registry without the cost of importing the model package (torch, transformers: ~7 s)."""
    from rl.models_cli import light_hub

    return light_hub()


def resolve_model_paths(m: ModelSection, *, pull: bool) -> ModelSection:
    """`model.arch` (and `model.reference`) read by the one model-argument resolver (rl/model_arg.py): a
    pullable pretrained model (model/hub.py) or a URL of exported weights becomes its checkpoint directory
    (with `pull=True` pulled first if this machine has not pulled it yet: cached, file-locked, offline after
    the first pull; with `pull=False` only if it is here already, else the name is kept), and a run's
    checkpoint directory its `hf/`. A checkpoint directory or a shipped config name is kept as written."""
    from rl.model_arg import ModelArgError, resolve_model

    def resolved(key: str, value: str) -> str:
        if key == "model.reference" and value == "initial":
            return value
        try:
            arg = resolve_model(value, pull=pull, what=f"config key '{key}'")
        except ModelArgError as e:
            raise ConfigError(str(e)) from e
        return value if arg.path is None or arg.path == Path(value) else str(arg.path)

    return dataclasses.replace(m, arch=resolved("model.arch", m.arch), reference=resolved("model.reference", m.reference))


def check_names(m: ModelSection) -> None:
    """`model.arch` names a shipped shape (configs/model/<name>.json), a pullable model, a JSON model config or a
    checkpoint directory, and `model.reference` is 'initial', a checkpoint directory or a pullable model: anything
    else is refused here, with the nearest name, before anything starts."""
    arch = m.arch
    shipped = sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))
    pullable = list(_hub().names())
    if not (arch in shipped or arch in pullable or (Path(arch) / "config.json").is_file() or
            (arch.endswith(".json") and Path(arch).is_file())):
        near = difflib.get_close_matches(arch, shipped + pullable, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"config key 'model.arch': {arch!r} is not a model{hint} (allowed: a shipped shape "
                          f"{', '.join(map(repr, shipped))}, a pullable model {', '.join(map(repr, pullable))} "
                          "(`jointrl models list`), or a checkpoint directory with config.json)")


def check_reference(m: ModelSection) -> None:
    """`model.reference`: 'initial', a checkpoint directory, or a pullable model."""
    if m.reference != "initial" and not (Path(m.reference) / "config.json").is_file() and m.reference not in _hub().names():
        raise ConfigError(f"config key 'model.reference': {m.reference!r} is neither 'initial' nor a checkpoint "
                          "directory with config.json")


def check_family(m: ModelSection) -> None:
    """A checkpoint directory in `model.arch` (or `model.reference`) must be of a family model/families.py
    supports: refused by name here, before any engine or trainer starts. A name not yet pulled is checked
    once start-up has pulled it (`resolve_model_paths`)."""
    for key, value in (("model.arch", m.arch), ("model.reference", m.reference)):
        config_json = Path(value) / "config.json"
        if not config_json.is_file():
            continue  # a shipped config name (or 'initial'); checked where it is built
        try:
            hf_config = json.loads(config_json.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"config key '{key}': cannot read {config_json}: {e}") from e
        from model.families import family_problem

        problem = family_problem(hf_config.get("model_type"))
        if problem:
            raise ConfigError(f"config key '{key}': {value!r}: {problem}")


def check_chat_codec(m: ModelSection) -> None:
    """`model.chat_codec` names a registered codec; the hf codec's parser names are vLLM-registered ones
    (checked against vLLM's registries, which costs an import of vLLM's parsers, only for hf); the jointrl
    codec parses its own format, so parser names other than the defaults would be dead there."""
    from rl.rollout import codec

    allowed = (codec.AUTO, *codec.codec_names())
    if m.chat_codec not in allowed:
        raise ConfigError(f"config key 'model.chat_codec': value {m.chat_codec!r} is not allowed; allowed values: "
                          f"{', '.join(repr(a) for a in allowed)}")
    if codec.resolve_codec_name(m.chat_codec, m.arch) != "hf":
        defaults = ModelSection()
        for key, value, default in (("tool_parser", m.tool_parser, defaults.tool_parser),
                                    ("reasoning_parser", m.reasoning_parser, defaults.reasoning_parser)):
            if value != default:
                raise ConfigError(f"config key 'model.{key}': {value!r} is read only by the hf chat codec, and this run uses "
                                  f"the jointrl codec (model.chat_codec={m.chat_codec!r}, model.arch={m.arch!r}); set "
                                  "model.chat_codec=hf or drop the key")
        return
    for key, kind, value in (("tool_parser", "tool", m.tool_parser), ("reasoning_parser", "reasoning", m.reasoning_parser)):
        if key == "reasoning_parser" and value == "":
            continue
        problem = codec.parser_name_problem(kind, value)
        if problem:
            raise ConfigError(f"config key 'model.{key}': {problem}")

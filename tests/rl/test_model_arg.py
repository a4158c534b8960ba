"""rl/model_arg.py: one reading of a model argument for train, eval, serve and jobs."""
from __future__ import annotations

import json

import pytest

from rl.model_arg import ModelArgError, resolve_model


def test_the_forms_in_order(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    a = resolve_model(str(ckpt))
    assert (a.kind, a.path, a.name) == ("checkpoint", ckpt, "ckpt")
    run = tmp_path / "run7"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    r = resolve_model(str(run))  # a run's checkpoint directory, as `jointrl eval` takes it
    assert (r.kind, r.path, r.name) == ("checkpoint", run / "hf", "run7")
    u = resolve_model("s3://bucket/model", pull=False)
    assert u.kind == "url" and u.path is None
    s = resolve_model("tiny")
    assert (s.kind, s.path, s.name) == ("shipped", None, "tiny")
    cfg = tmp_path / "mine.json"
    cfg.write_text(json.dumps({}))
    assert resolve_model(str(cfg)).name == "mine"


def test_a_pullable_name_without_pulling():
    from rl.models_cli import light_hub

    hub = light_hub()
    name = hub.names()[0]
    a = resolve_model(name, pull=False)
    assert a.kind == "pullable" and a.name == name
    assert a.path == (hub.local_path(name) if hub.is_cached(name) else None)


def test_an_unknown_name_fails_naming_every_form(tmp_path):
    bad = resolve_model(str(tmp_path / "nope"))
    assert bad.kind == "shipped"  # read lazily: nothing is built or imported until a caller asks for weights
    with pytest.raises(ModelArgError) as e:
        bad.checkpoint(cache_dir=tmp_path / "cache")
    for form in ("shipped model config", "pullable model", "checkpoint directory", "URL"):
        assert form in str(e.value)
    assert not (tmp_path / "cache").exists()  # refused before anything was written

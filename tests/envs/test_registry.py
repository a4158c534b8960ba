"""Registry, entry-point discovery, task sets as cached HF datasets."""
from __future__ import annotations

import importlib.metadata

import pytest

import envs
from envs import registry
from jointrl.records import Message, Task


def _tasks(split, seed, n):
    n = 3 if n is None else n
    return [Task(id=f"toy/{split}/{seed}/{i}", domain="toy", prompt=(Message(role="user", content=f"{seed}-{i}"),),
                 private={"variant": f"{split}{i}"}, split=split) for i in range(n)]


def _factory(**kw):
    raise AssertionError("not built in these tests")


@pytest.fixture
def toy_id():
    env_id = "toy-registry-v0"
    registry.register(env_id, _factory, _tasks)
    yield env_id
    registry._REGISTRY.pop(env_id, None)


def test_builtin_entry_point_is_declared_and_discovered():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="jointrl.envs")}
    assert eps.get("builtin") == "envs.builtin:register_all"
    assert "terminal-v0" in [s.env_id for s in envs.list_envs()]


def test_register_validates_ids_and_refuses_duplicates(toy_id):
    assert registry.register(toy_id, _factory, _tasks).env_id == toy_id  # same callables: a no-op
    with pytest.raises(ValueError, match="already registered.*toy-registry-v1"):
        registry.register(toy_id, lambda **kw: None, _tasks)
    for bad in ("Toy-v0", "toy", "toy-v", "toy_v0"):
        with pytest.raises(ValueError, match="must look like"):
            registry.register(bad, _factory, _tasks)


def test_unknown_ids_and_splits_are_named_in_errors(toy_id):
    with pytest.raises(KeyError, match="unknown env id 'nope-v0'; registered: .*terminal-v0"):
        envs.make("nope-v0")
    with pytest.raises(ValueError, match="unknown split 'test'; splits are: train, heldout"):
        envs.generate_tasks(toy_id, "test")


def test_a_broken_plugin_is_skipped_and_reported(monkeypatch):
    class EP:
        name, value = "broken", "nowhere:register"

        def load(self):
            raise ImportError("no module named nowhere")

    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setattr(registry, "_DISCOVERY_ERRORS", {})
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [EP()])
    registry._discover()
    assert "nowhere" in registry.discovery_errors()["broken"]


def test_builtin_skips_domains_with_missing_optional_dependencies(monkeypatch):
    from envs import builtin

    monkeypatch.setattr(builtin, "SKIPPED", {})
    builtin._try("ghost", "some_uninstalled_dep_xyz:register")
    builtin._try("buggy", "envs.no_such_module_xyz:register")
    assert builtin.SKIPPED["ghost"].startswith("optional dependency missing")
    assert builtin.SKIPPED["buggy"].startswith("error")


def test_tasks_are_a_cached_deterministic_dataset(toy_id, tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    ds = envs.tasks(toy_id, "train", seed=7, n=4)
    assert len(ds) == 4 and set(ds.column_names) == {"id", "domain", "prompt", "public", "private", "limits", "thinking", "split"}
    assert Task.from_row(ds[2]) == _tasks("train", 7, 4)[2]
    cached = list((tmp_path / "envs" / toy_id).iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("train-seed7-n4-")
    again = envs.tasks(toy_id, "train", seed=7, n=4)
    assert again.to_list() == ds.to_list()
    assert envs.tasks(toy_id, "train", seed=8, n=4)[0]["id"] != ds[0]["id"]
    assert len(envs.tasks(toy_id, "heldout", seed=7, n=0)) == 0


def test_generator_output_is_validated(monkeypatch):
    env_id = "toy-bad-v0"
    registry.register(env_id, _factory, lambda split, seed, n: [_tasks("train", 0, 1)[0]] * 2)
    try:
        with pytest.raises(ValueError, match="duplicate task ids"):
            envs.generate_tasks(env_id, "train")
        with pytest.raises(ValueError, match="says split 'train'"):
            envs.generate_tasks(env_id, "heldout")
    finally:
        registry._REGISTRY.pop(env_id, None)

"""scripts/many_domains_config.py: the config it writes loads and validates, with every rg domain of the default mix in it."""
from __future__ import annotations

import subprocess
import sys

import envs
from rl.config import load_config
from tests import REPO


def test_the_written_config_validates_with_every_rg_domain(tmp_path):
    out = tmp_path / "rg.yaml"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "many_domains_config.py"), "--out", str(out), "--steps", "3",
                        "--eval-budget", "150"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = load_config(out)
    rg = {s.env_id for s in envs.list_envs() if s.env_id.startswith("rg-") and s.default_mix}
    marked = {s.env_id for s in envs.list_envs() if s.env_id.startswith("rg-") and not s.default_mix}
    assert len(rg) >= 70 and set(cfg.envs.weights) == rg and cfg.envs.env_ids == {d: d for d in rg}
    assert marked and not marked & set(cfg.envs.weights)  # constant-answer priors stay out of the mix
    assert cfg.trainer.steps == 3 and cfg.eval.budget_episodes == 150 and cfg.envs.sampler_level == "family"

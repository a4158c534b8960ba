"""terminal-v0: procedurally generated shell tasks (14 families) graded on the final filesystem state."""
from __future__ import annotations

from envs.base import ToolEnv


def make_env(*, backend=None, sandbox_limits=None, **env_kwargs) -> ToolEnv:
    """`envs.make("terminal-v0", backend=..., sandbox_limits=..., limits=..., max_calls_per_turn=...)`."""
    from envs.terminal.domain import TerminalDomain

    kw = {} if sandbox_limits is None else {"sandbox_limits": sandbox_limits}
    return ToolEnv(TerminalDomain(backend=backend, **kw), **env_kwargs)


def register() -> None:
    from envs.registry import register as reg
    from envs.terminal.tasks import BASICS_ENV_ID, ENV_ID, make_basics_tasks, make_tasks

    reg(ENV_ID, make_env, make_tasks,
        description="shell tasks in a bubblewrap sandbox: text/JSON/CSV wrangling, archives, permissions, scripts, git, sqlite, logs, cron")
    reg(BASICS_ENV_ID, make_env, make_basics_tasks,
        description="one-command shell tasks (echo, wc, head, cp) in the same sandbox: the first rung of the terminal curriculum")
    from envs.terminal import longhorizon

    reg(longhorizon.ENV_ID, longhorizon.make_env, longhorizon.make_tasks,
        description="a trail of 20-27 logs read one call at a time, whose whole history outgrows the context: the long-horizon rung")
    reg(longhorizon.XL_ENV_ID, longhorizon.make_env, longhorizon.make_xl_tasks,
        description="the long-horizon rung with five times the log noise: episodes past 16k tokens, for long-sequence training")

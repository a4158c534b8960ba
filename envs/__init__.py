"""Environments: the typed Env API, the registry, task sets, and the built-in domains.

    env = envs.make("terminal-v0")
    ds = envs.tasks("terminal-v0", "train", seed=0)      # datasets.Dataset of Task rows
    task = envs.Task.from_row(ds[0])
    messages, tools = await env.reset(task)
    result = await env.step(assistant_message)           # StepResult
    grade = await env.grade()                            # Grade (never raises)
    env.close()

See docs/envs.md. Heavy modules (datasets, sandbox backends) are imported only when used.
"""
from envs.base import Domain, Env, EnvSetupError, EnvUsageError, ToolEnv, ToolInvocation, ToolOutput, clip_observation
from envs.registry import (SPLITS, EnvSpec, discovery_errors, generate_tasks, list_envs, load_plugins, make, register, spec,
                           tasks)
from envs.tools import ToolArgError, ToolContext, tool
from jointrl.records import Grade, Limits, Message, StepResult, Task, ToolCall

__all__ = [
    "Domain", "Env", "EnvSetupError", "EnvSpec", "EnvUsageError", "Grade", "Limits", "Message", "SPLITS",
    "StepResult", "Task", "ToolArgError", "ToolCall", "ToolContext", "ToolEnv", "ToolInvocation", "ToolOutput",
    "clip_observation", "discovery_errors", "generate_tasks", "list_envs", "load_plugins", "make", "register", "spec", "tasks",
    "tool",
]

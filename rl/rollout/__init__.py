"""vLLM rollout engines, workers and the dispatcher (see docs/rollout.md)."""

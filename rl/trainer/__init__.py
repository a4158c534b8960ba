"""DeepSpeed policy trainer: batches from episodes, old-policy logprobs with routing replay, RL and SFT steps.

`batch.py` turns episodes into padded tensors; `policy.py` holds `PolicyTrainer` (a plain class,
testable on CPU without Ray); `actor.py` wraps it as a Ray actor for the driver.
"""

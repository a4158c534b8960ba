"""Fixtures for the model-core tests (test_delta / test_dsa / test_moe / test_model / test_config).

One torch thread while they run: their tensors are tiny, and on a busy 2-core machine two OpenMP threads made
each small op wait for a scheduler slice (a 2x6-token forward of the test model took ~0.8 s instead of ~30 ms).
Scoped to these modules and restored afterwards, so other tests in this folder and elsewhere are unaffected.
"""
from __future__ import annotations

import pytest
import torch

_MODEL_CORE_TESTS = {"test_delta", "test_dsa", "test_moe", "test_model", "test_config"}


@pytest.fixture(autouse=True)
def _one_torch_thread_for_model_core(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in _MODEL_CORE_TESTS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

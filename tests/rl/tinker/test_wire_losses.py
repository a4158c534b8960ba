"""rl/tinker/wire.py against the tinker SDK's own protobuf code, and rl/tinker/losses.py against Tinker's loss formulas.

Fast: no model, no server. The SDK (tinker 0.38.0, the test extra) writes the request bodies the service
reads and reads the result bodies it writes, so both directions are checked against the real client.
The losses are checked against the formulas of the Tinker documentation, written out here elementwise.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from rl.tinker import wire  # noqa: E402
from rl.tinker.losses import LossRequestError, check_loss, tinker_loss  # noqa: E402


def _request(data, loss="ppo", config=None, forward_only=False) -> bytes:
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
                                       model_id="s:train:0", seq_id=7)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_forward_backward_request_decodes_as_the_sdk_wrote_it():
    a = types.Datum(model_input=types.ModelInput.from_ints([3, 1, 4, 1, 5]),
                    loss_fn_inputs={"target_tokens": [1, 4, 1, 5, 9], "logprobs": [-1.0, -2.0, -0.5, -0.25, -3.0],
                                    "advantages": [0.0, 0.0, 1.5, 1.5, -2.0]})
    sparse = torch.zeros(3, 4, dtype=torch.int64)
    sparse[1, 2] = 7
    b = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[2, 6]), types.EncodedTextChunk(tokens=[5])]),
                    loss_fn_inputs={"target_tokens": types.TensorData.from_torch_sparse(sparse)})
    got = wire.decode_forward_backward(_request([a, b], "ppo", {"clip_low_threshold": 0.7}, forward_only=True), 10, 1000)
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 7, "ppo", True)
    assert dict(got.loss_fn_config) == {"clip_low_threshold": 0.7}
    da, db = got.data
    assert da.tokens.tolist() == [3, 1, 4, 1, 5] and db.tokens.tolist() == [2, 6, 5]
    ins = dict(da.inputs)
    assert ins["target_tokens"].values.tolist() == [1, 4, 1, 5, 9]
    np.testing.assert_array_equal(ins["advantages"].values, np.float32([0, 0, 1.5, 1.5, -2]))
    dense = dict(db.inputs)["target_tokens"]
    assert dense.shape == (3, 4) and dense.values.reshape(3, 4).tolist() == sparse.tolist()


def test_malformed_and_oversized_bodies_are_refused():
    d = types.Datum(model_input=types.ModelInput.from_ints(list(range(50))), loss_fn_inputs={"target_tokens": list(range(50))})
    body = _request([d, d], "cross_entropy")
    with pytest.raises(wire.WireError, match="limit is 1"):
        wire.decode_forward_backward(body, 1, 1000)
    with pytest.raises(wire.WireError, match="limit of 10"):
        wire.decode_forward_backward(body, 10, 10)
    for bad in (body[:-3], b"\xff" * 12, b"\x0a\xff\xff\xff\xff\x0f"):
        with pytest.raises(wire.WireError):
            wire.decode_forward_backward(bad, 10, 1000)


def test_results_read_back_through_the_sdk():
    outs = [{"logprobs": np.float32([-1, -2.5]), "elementwise_loss": np.float32([0.5, 0])}, {"logprobs": np.float32([-3]),
                                                                                                 "elementwise_loss": np.float32([1])}]
    r = deserialize_forward_backward_output(wire.encode_forward_backward_output(outs, {"loss:sum": 4.5}))
    assert r.metrics == {"loss:sum": 4.5}
    assert [o["logprobs"].tolist() for o in r.loss_fn_outputs] == [[-1, -2.5], [-3]]
    assert r.loss_fn_outputs[1]["elementwise_loss"].tolist() == [1]
    s = deserialize_sample_response(wire.encode_sample_response(
        [wire.WireSequence(np.array([5, 6, 7]), np.array([-0.5, -0.25, -2.0]), stop=True),
         wire.WireSequence(np.array([9]), np.array([-1.0]), stop=False)], np.array([np.nan, -1.5, -2.0])))
    assert [q.tokens for q in s.sequences] == [[5, 6, 7], [9]]
    assert [q.stop_reason for q in s.sequences] == ["stop", "length"]
    assert s.sequences[0].logprobs == [-0.5, -0.25, -2.0]
    assert s.prompt_logprobs == [None, -1.5, -2.0]


# ----------------------------------------------------------------------------- losses
LP = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.1, -4.0, 0.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.3, -1.0, -0.5, -2.0], [-0.9, -1.1, -1.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -2.0, 0.0, 0.5], [2.0, -1.0, 1.0, 0.0]], dtype=torch.float64)
W = torch.tensor([[0.0, 1.0, 0.5, 1.0], [1.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def _reference(name: str, lo: float = 0.8, hi: float = 1.2) -> float:
    """Tinker's definitions, one position at a time."""
    total = 0.0
    for b in range(2):
        for t in range(4):
            if not MASK[b, t]:
                continue
            lp, old, a, w = float(LP[b, t]), float(OLD[b, t]), float(ADV[b, t]), float(W[b, t])
            r = math.exp(lp - old)
            if name == "cross_entropy":
                total += -w * lp
            elif name == "importance_sampling":
                total += -r * a
            elif name == "ppo":
                total += -min(r * a, min(max(r, lo), hi) * a)
            elif name == "cispo":
                total += -min(max(r, lo), hi) * a  # the value rl/algos reports; the gradient is checked below
    return total


@pytest.mark.parametrize("name,config", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                         ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}), ("cispo", {})])
def test_loss_values_follow_tinkers_formulas(name, config):
    check_loss(name, config)
    inputs = {"weights": W, "logprobs": OLD, "advantages": ADV}
    loss, per_BT = tinker_loss(name, LP.clone().requires_grad_(), inputs, MASK, config)
    want = _reference(name, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert float(per_BT.sum()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert float(per_BT[1, 3]) == 0.0  # padding carries nothing


def test_gradients_of_the_rl_losses():
    """d loss / d logp: importance sampling -A r; ppo -A r where unclipped (0 where the clip binds); cispo -clip(r) A."""
    r = torch.exp(LP - OLD)
    for name in ("importance_sampling", "ppo", "cispo"):
        lp = LP.clone().requires_grad_()
        loss, _ = tinker_loss(name, lp, {"logprobs": OLD, "advantages": ADV}, MASK, {})
        loss.backward()
        if name == "importance_sampling":
            want = -ADV * r
        elif name == "ppo":
            unclipped = ~(((ADV > 0) & (r > 1.2)) | ((ADV < 0) & (r < 0.8)))
            want = torch.where(unclipped, -ADV * r, torch.zeros_like(r))
        else:
            want = -r.clamp(0.8, 1.2) * ADV
        torch.testing.assert_close(lp.grad, want * MASK, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,config,match", [("dro", {}, "not supported"), ("gspo", {}, "not supported"), ("custom", {}, "not supported"),
                                               ("nope", {}, "unknown loss_fn"), ("ppo", {"beta": 1.0}, "not read"),
                                               ("ppo", {"clip_low_threshold": 1.5}, "clip thresholds"),
                                               ("cross_entropy", {"clip_low_threshold": 0.5}, "not read")])
def test_refused_losses_and_configs(name, config, match):
    with pytest.raises(LossRequestError, match=match):
        check_loss(name, config)

"""The engine <-> stage channel's frames: tensors cross as raw bytes with a declared dtype and shape,
plans as strict JSON; anything malformed is refused with a reason."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.backend.connector_data import LoadPlan, SavePlan, StageObjects
from kvpool.backend.serve import stage_link as link
from kvpool.policy.layout import HandoffPlan


def test_tensors_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    y = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    header, got = link.decode(link.encode({"id": 3, "cmd": "compute"}, [x, y]))
    assert header["id"] == 3 and header["cmd"] == "compute"
    assert torch.equal(got[0], x) and got[1].dtype == torch.bfloat16 and torch.equal(got[1].view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("frames, reason", [
    ([b"\x80\x04pickle"], "not JSON"),
    ([json.dumps({"id": 1}).encode()], "'cmd'"),
    ([json.dumps({"id": 1, "cmd": "x", "tensors": [{"dtype": "float32", "shape": [2]}]}).encode(), b"\0" * 7], "do not match"),
    ([json.dumps({"id": 1, "cmd": "x", "tensors": [{"dtype": "object", "shape": [1]}]}).encode(), b"\0"], "dtype"),
    ([json.dumps({"id": 1, "cmd": "x", "tensors": []}).encode(), b"\0"], "declares 0 tensors"),
])
def test_malformed_messages_are_refused(frames, reason):
    with pytest.raises(link.LinkError, match=reason):
        link.decode(frames)


def test_plans_round_trip_and_a_mistyped_field_is_refused():
    objs = (StageObjects(0, ("k0", "k1"), 100), StageObjects(1, ("j0", "j1"), 80))
    load = LoadPlan("r", 1, 3, objs, 128, False)
    save = SavePlan("r", 0, 2, ("g0", "g1"), objs)
    hand = HandoffPlan(100, 2, 1152, 2, 1 << 18, 0)
    wire = json.loads(json.dumps({"l": link.load_plan_json(load), "s": link.save_plan_json(save),
                                  "h": link.handoff_plan_json(hand)}))
    assert link.load_plan_from_json(wire["l"]) == load
    assert link.save_plan_from_json(wire["s"]) == save
    assert link.handoff_plan_from_json(wire["h"]) == hand
    with pytest.raises(link.LinkError, match="first_chunk"):
        link.load_plan_from_json({**wire["l"], "first_chunk": "1"})
    with pytest.raises(link.LinkError, match="handoff plan"):
        link.handoff_plan_from_json({**wire["h"], "ranks": 0})


def test_a_received_tensor_shares_the_frame_and_a_sent_one_is_not_copied():
    """The hidden states cross stage -> engine -> stage as frames that no process copies: the
    tensor decoded from a received frame is a view of it, and an encoded CPU tensor's frame is a
    view of the tensor."""
    import zmq

    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    frames = link.encode({"id": 1, "cmd": "compute"}, [x])
    assert isinstance(frames[1], memoryview)
    x[0, 0] = 7.0
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)[0] == 7.0

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        a.send_multipart(frames, copy=False)
        assert b.poll(5000)
        received = b.recv_multipart(copy=False)
        _, (got,) = link.decode(received)
        assert torch.equal(got, x)
        received[1].buffer[:4] = torch.tensor([1.5], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
        assert got[0, 0] == 1.5
    finally:
        a.close(0)
        b.close(0)
        ctx.term()

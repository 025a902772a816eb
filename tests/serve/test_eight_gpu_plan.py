"""The eight-GPU layout (``scenarios/h200x8-tiny.toml``): the seed's 1P1D with one GPU per worker.

``build_plan`` places prefill stage ``s`` on ``cuda:s`` and the decode instance's TP4 ranks on
``cuda:4..7`` (its DCP rank ``r``'s KV on ``cuda:4+r``, ``decode_core``'s rule), so every stage's
hand-off crosses from its GPU to the four decode GPUs. On a machine with fewer GPUs ``kvpool serve``
refuses it with one ``error:`` line before anything starts.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.backend.serve.plan import build_plan
from kvpool.cli import main as kvpool_main
from kvpool.scenario.load import load_scenario


def test_stages_take_gpus_0_to_3_and_the_decode_ranks_gpus_4_to_7(tmp_path):
    s = load_scenario("h200x8-tiny")
    plan = build_plan(s, tmp_path, router_port=0)
    devices = {w.name: w.devices for w in plan.workers}
    assert devices == {"prefill0-stage0": ("cuda:0",), "prefill0-stage1": ("cuda:1",),
                       "prefill0-stage2": ("cuda:2",), "prefill0-stage3": ("cuda:3",),
                       "prefill0": (), "decode0": ("cuda:4", "cuda:5", "cuda:6", "cuda:7")}
    assert (s.prefill.pp, s.decode.tp, s.decode.dcp) == (4, 4, 4)
    assert tuple(s.prefill.stage_layers) == (4, 4, 4, 4)
    # the same layout as h200-tiny, which folds it onto one GPU
    folded = load_scenario("h200-tiny")
    assert s.model == folded.model and s.prefill == folded.prefill and s.decode == folded.decode
    assert s.serve.model_dump(exclude={"devices", "prefill_kv_tokens"}) == \
        folded.serve.model_dump(exclude={"devices", "prefill_kv_tokens"})


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 8, reason="this machine has 8 GPUs")
def test_serve_refuses_the_layout_on_a_machine_without_eight_gpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        kvpool_main(["serve", "h200x8-tiny", "--port", "0", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: serve.devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7: cuda:"), err
    assert "is not on this machine" in err[0]
    assert not (tmp_path / "run").exists()

"""The eight-GPU layout (``scenarios/h200x8-tiny.toml``): the seed's 1P1D with one GPU per worker.

``build_plan`` places prefill stage ``s`` on ``cuda:s`` and the decode instance's TP4 ranks on
``cuda:4..7`` (its DCP rank ``r``'s KV on ``cuda:4+r``, ``decode_core``'s rule), so every stage's
hand-off crosses from its GPU to the four decode GPUs. On a machine with fewer GPUs ``kvpool serve``
refuses it with one ``error:`` line before anything starts. With every worker on the CPU (and a
narrower model) the same processes serve a session as the no-cache recompute does.
"""

from __future__ import annotations

import random

import pytest
import torch
from serve_process import START_BOUND_S, RealServe, post

from kvpool.backend.serve import launch
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.plan import build_plan
from kvpool.backend.serve.reference import reference_generate
from kvpool.cli import main as kvpool_main
from kvpool.scenario.load import load_scenario

#: The layout on the CPU: every worker there, the model narrowed (its 16 layers in four stages, its
#: FP8 records and its indexer layers unchanged), so that a session's turns take seconds.
CPU_SETS = ['serve.devices=["cpu"]', "serve.d_model=128", "serve.heads=2", "serve.ffn_dim=256", "serve.vocab=512",
            "serve.prefill_kv_tokens=8192", "serve.decode_kv_tokens=32768", "serve.index_topk=32",
            "serve.index_heads=4"]
LAYOUT_TOKEN_BYTES = 16 * 576 + 4 * 144  # every layer's MLA record, and the indexer's key on layers 2, 6, 10, 14


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


def test_the_layout_on_the_cpu_decodes_as_the_no_cache_recompute(tmp_path):
    """Four stages of four layers (one indexer layer each) and the decode instance's four DCP ranks,
    every process on the CPU: two turns of a session decode exactly the no-cache recompute's tokens,
    the second from the prefix cache, and each hand-off moves the prompt's records of every layer."""
    s = load_scenario("h200x8-tiny", CPU_SETS)
    config = ref_config(s)
    assert config.bytes_per_token == LAYOUT_TOKEN_BYTES and config.indexer_layers == (2, 6, 10, 14)
    rng = random.Random(5)
    prompt = [rng.randrange(s.serve.vocab) for _ in range(300)]
    served = RealServe(launch.start_serve("h200x8-tiny", CPU_SETS, tmp_path / "run", ready_timeout_s=START_BOUND_S))
    try:
        records = []
        for turn in (1, 2):
            status, body = post(served.url, {"model": s.model.name, "prompt": prompt, "max_tokens": 8,
                                             "ignore_eos": True}, model=False)
            assert status == 200, body
            answer = body["choices"][0]["token_ids"]
            assert answer == reference_generate(config, prompt, 8, s.decode.dcp), f"turn {turn}"
            record = body["kvpool"]["record"]
            assert record["handoff_bytes"] == len(prompt) * LAYOUT_TOKEN_BYTES, record
            records.append(record)
            prompt = prompt + answer + [rng.randrange(s.serve.vocab) for _ in range(40)]
    finally:
        status = served.stop()  # asserts every process of router.ready.json is gone
    assert status == 0, served.output()[-4000:]
    sources = [(r["gpu_tokens"], r["pool_tokens"], r["computed_tokens"]) for r in records]
    assert sources == [(0, 0, 300), (288, 0, 60)], sources  # turn 1's 18 full pages from the prefix cache

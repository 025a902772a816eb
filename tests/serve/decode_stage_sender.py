"""A prefill stage for the decode engine tests: ``python decode_stage_sender.py STAGE ENDPOINTS_JSON TIMEOUT_S``.

It computes a prompt's KV with ``RefModel.prefill`` (the cpu-tiny model, ``serve.request_timeout_s``
set to TIMEOUT_S) and hands its stage's layers to the decode ranks at ENDPOINTS with
``backend.handoff.PrefillStage`` over the production-mode transport. Commands are JSON lines on
stdin: ``{"send": request_id, "prompt": [ids]}``; each answer is one JSON line on stdout:
``{"first": token, "bytes": n}`` or ``{"error": reason}``. The first line is ``{"ready": true}``
once connected. End of stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kvpool.backend.handoff import HandoffError, PrefillStage, make_transport
from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve.model_config import ref_config
from kvpool.scenario.load import load_scenario


def main() -> None:
    stage, endpoints, timeout_s = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    scenario = load_scenario("cpu-tiny", [f"serve.request_timeout_s={timeout_s}"])
    cfg = ref_config(scenario)
    torch.set_num_threads(1)
    model = RefModel(cfg)
    ps = PrefillStage(stage, make_transport(hp.TRANSPORT), staging_bytes=4 << 20, credit_timeout_s=5.0)
    target = ps.connect(endpoints)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        prompt = cmd["prompt"]
        table = torch.arange(-(-len(prompt) // cfg.page_tokens))
        caches = model.new_caches(table.numel())
        first = int(model.prefill(prompt, caches, table).argmax())
        try:
            rep = ps.send(cmd["send"], target, caches[stage], table, hp.stage_plan(scenario, stage, len(prompt)),
                          timeout_s=10.0)
            print(json.dumps({"first": first, "bytes": rep.handoff_bytes}), flush=True)
        except HandoffError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
    ps.close()
    os._exit(0)   # skip the transports' teardown at interpreter exit


if __name__ == "__main__":
    main()

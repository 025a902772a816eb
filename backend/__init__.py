"""Real KV paths: pool clients (embedded and Mooncake), the stage-aligned store connector, the
prefill -> decode handoff and production mode. Heavy dependencies (torch, mooncake) are imported
lazily by the modules that need them, so ``import kvpool.backend`` is always cheap.
"""

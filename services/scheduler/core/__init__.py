"""The scheduler core: who runs (scheduler.py), request state (request.py) and which blocks (kv_cache_manager.py, block_pool.py, state_snapshots.py). Integers and hashes only: no tensors, no NATS."""

"""The scheduler core: who runs and with how many tokens (scheduler.py), which requests it holds
and how they enter (admission.py) and move between waiting and running (request_queues.py),
speculation's slots and counters (speculation.py), when a request stops (stop.py), what a step
becomes on the wire (step_output.py), and which blocks (kv_cache_manager.py, block_pool.py,
state_snapshots.py). Integers and hashes only: no tensors, no NATS."""

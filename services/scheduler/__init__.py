"""The scheduler: its core (core/: who runs, which blocks), the engine core that drives a
worker step after step (engine_core.py), and its NATS shell (shell/: the fleet of workers,
the gateways it answers)."""

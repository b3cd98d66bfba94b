"""LoRA adapters: loading one (adapter.py) and the slots that hold them on the worker (manager.py)."""

"""The worker: the model runner (model_runner.py) over the model (models/), its layers,
attention backends and sampling (sample/), and its NATS shell (shell/)."""

import kernels  # noqa: F401 - picks Triton's interpreter on a CPU machine before triton loads

"""Tensor parallelism: a worker that is N processes (ranks) in one torch.distributed group,
each holding a slice of every layer and of the KV cache, stepping together.

group.py is the group (NCCL on GPUs, gloo on CPU, and a gloo group for the steps);
sharding.py cuts the decoder's config and checkpoint into a rank's slice; ranks.py starts
the ranks and hands each step from rank 0 (the worker on the bus) to the others."""

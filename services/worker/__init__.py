import kernels  # noqa: F401 - picks Triton's interpreter on a CPU machine before triton loads

import kernels_pallas  # noqa: F401  (registers Pallas' tracing option before any jit runs; see its docstring)

"""Tile-size rules shared by every Pallas-Triton kernel here, and which GPU platform the default backend is."""

from __future__ import annotations

import jax

MIN_DOT = 16  # Triton's smallest dot dimension
PLATFORMS = ("cuda", "rocm", "cpu")  # keys of the kernels' Config.default heuristics ("cpu" = interpret mode)


def is_pow2(n) -> bool:
  """Pallas-Triton tensors must have power-of-two sizes."""
  return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n (1 if n is odd)."""
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def default_platform() -> str:
  """"cuda", "rocm" or "cpu" for the default JAX backend."""
  backend = jax.default_backend()
  if backend == "gpu":
    version = getattr(getattr(jax.devices()[0], "client", None), "platform_version", "") or ""
    return "rocm" if "rocm" in version.lower() or "hip" in version.lower() else "cuda"
  return backend if backend in PLATFORMS else "cpu"

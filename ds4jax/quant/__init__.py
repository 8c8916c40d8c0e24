"""Weight quantization formats, one module per format.

Each format module has ONE canonical `dequantize(codes, scales) -> float32` written with jnp ops: pure, shape-static,
usable eagerly on numpy inputs, under jit, and later inside Pallas kernels. Byte VALUES cannot be validated under jit, so
each module also has numpy-side checks (e.g. `ue8m0.check_scale_bytes`) that loaders run once on the host, and a numpy
`quantize` encoder for tests and random weights.

* `ue8m0`    – the shared power-of-two scale byte (value = 2^(byte - 127)).
* `fp8_e4m3` – DeepSeek dense weights: float8_e4m3fn with one UE8M0 scale per 128×128 block.
* `fp4_e2m1` – DeepSeek routed experts: two E2M1 nibbles per byte with one UE8M0 scale per 32 inputs.
"""

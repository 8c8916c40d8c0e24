"""Weight quantization formats, one module per format.

Each format module has ONE canonical `dequantize(codes, scales) -> float32` written with jnp ops: pure, shape-static,
usable eagerly on numpy inputs, under jit, and later inside Pallas kernels. Byte VALUES cannot be validated under jit,
so each module also has numpy-side checks (e.g. `ue8m0.check_scale_bytes`) that loaders run once on the host, and a
numpy `quantize` encoder for tests and random weights.

* `ue8m0`    – the shared power-of-two scale byte (value = 2^(byte - 127)).
* `fp8_e4m3` – DeepSeek dense weights: float8_e4m3fn with one UE8M0 scale per 128×128 block.
* `fp4_e2m1` – DeepSeek routed experts: two E2M1 nibbles per byte with one UE8M0 scale per 32 inputs.
* `ue4m3`    – the 7-bit scale byte of the ROCmFP formats ((8 + mant) · 2^(exp - 11); 0x7F and above invalid).
* `rocmfp2`, `rocmfp3` – Lucebox's Q2_0_ROCMFP2 / Q3_0_ROCMFPX: 2- and 3-bit codes, one UE4M3 scale per 16 weights
  (2.5 / 3.5 bits per weight), stored as power-of-two bit planes, with lossless converters to upstream's blocks.
* `rocmfp2_mix`, `rocmfp3_mix` – the MIX variants: per-expert pairs of BF16 codebooks and a mode byte
  (`rocmfp_mix` holds what they share).
* `formats`  – the registry: `formats.get(name)` → `Format` with quantize / dequantize / check / nbytes for
  bf16, fp8_e4m3, fp4_e2m1 and the four ROCmFP formats.

Helpers: `bitplanes` (pack / in-kernel unpack of 1-, 2-, 4-bit codes), `rocmfp_layout` (block geometry and argument
checks), `scale_search` (the encoders' exact least-squares search over scale bytes and codebooks).
"""

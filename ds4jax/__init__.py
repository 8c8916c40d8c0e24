"""ds4jax: the DeepSeek-V4-Flash model, its prefill optimizations as switches, and their qualification."""

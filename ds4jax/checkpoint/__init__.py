"""Reading DeepSeek-V4 checkpoints from disk (safetensors, without torch)."""

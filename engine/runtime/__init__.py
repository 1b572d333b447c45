"""What runs a model: the Llama forward, its KV cache, the linear kernels and formats, loading a GGUF or a
checkpoint, the device and thread choices, and the tokenizer."""

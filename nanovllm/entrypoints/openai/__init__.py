"""OpenAI-compatible HTTP server (`nanovllm serve`); needs the `serve` extra."""

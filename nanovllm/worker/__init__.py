"""The worker layer: one rank's model and KV cache (model_runner), the step's inputs and outputs
(step), the sampling side of rank 0 (token_sampler), and the tensor-parallel worker process
(worker, `python -m nanovllm.worker`). See docs/design.md, "Layers"."""

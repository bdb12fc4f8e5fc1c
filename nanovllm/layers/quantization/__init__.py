"""Weight-only int8 / int4 quantization: checkpoint formats (compressed-tensors pack-quantized, AWQ
GEMM, GPTQ), round-to-nearest quantization, and the GEMMs that read the packed weights (CPU:
csrc/cpu_gemm_quant.cpp; CUDA: a Triton kernel). See docs/design.md, "Quantized weights"."""

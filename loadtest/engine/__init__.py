"""In-process engine benchmarks: the runner, kernels, quantization and KV cache measured without a server."""

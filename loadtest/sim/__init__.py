"""The simulator: static vs continuous batching replayed on a workload at measured step costs."""

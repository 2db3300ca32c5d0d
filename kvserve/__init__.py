"""kvserve: an LLM inference server (continuous batching over a paged KV cache, quantized weights, OpenAI-compatible
SSE).

Its subpackages are the folders at the top of the repository, installed under this one name (pyproject.toml's
package-dir): ``kvserve.server`` (HTTP), ``kvserve.scheduler``, ``kvserve.kvcache``, ``kvserve.engine``,
``kvserve.quant``, ``kvserve.native`` (native code), ``kvserve.planner``, ``kvserve.clients`` and
``kvserve.loadtest``.
"""

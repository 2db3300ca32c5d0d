"""Benchmarks of a served model: each starts kvserve (or a peer) and measures it over HTTP."""

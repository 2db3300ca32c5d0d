"""Publishing: each benchmark's section of BENCHMARKS.md, stamped with its command, machine and date."""

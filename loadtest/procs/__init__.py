"""The process harness: start kvserve servers, replicas and a router as child processes, and stop them."""

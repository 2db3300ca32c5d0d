"""The HTTP load generator: workloads, a streaming client, closed/open-loop runs, reports, and a fake server."""

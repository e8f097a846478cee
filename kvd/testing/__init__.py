"""Helpers for tests, the demo and the bench: global KV patterns, in-memory engines, daemons as subprocesses and their /metrics."""

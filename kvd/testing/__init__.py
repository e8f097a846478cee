"""Helpers for tests, the demo and the bench: global KV patterns and in-memory engines."""

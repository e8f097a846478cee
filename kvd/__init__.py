"""kvd: a standalone KV-cache transfer daemon for disaggregated prefill/decode serving."""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""kvd: a standalone KV-cache transfer daemon for disaggregated prefill/decode serving."""

__version__ = "0.2.0"

__all__ = ["__version__"]

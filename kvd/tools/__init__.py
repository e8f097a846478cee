"""Operator tools built on the daemon: ``kvd demo`` and ``kvd bench``."""

"""The pure core: what kvd decides, with no I/O.

Nothing here opens a socket, starts a thread, reads a clock or imports grpc
or generated protobuf code (an import-linter contract in pyproject.toml
checks it). Time comes in as an argument; the shells in ``kvd.daemon`` and
``kvd.transport`` feed these modules events and execute what they return.
"""

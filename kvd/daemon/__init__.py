"""The daemon: composition (daemon.py), gRPC shell (service.py), metrics."""

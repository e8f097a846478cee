"""Data-plane transports. ``base`` is the interface the daemon drives;
``tcp`` is the built-in cross-host transport."""

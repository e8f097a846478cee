"""One config model for ``kvd serve``: a YAML file, then ``KVD_*`` environment
variables, then command-line flags; each later source wins.

Every key is a field of ``DaemonConfig``. Values are validated at startup, and
a wrong one is reported in one line naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.core.addresses import bare_host
from kvd.core.errors import InvalidArgument
from kvd.core.leases import DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS
from kvd.core.qos import parse_shares
from kvd.core.spec import WorkerId
from kvd.core.transfer import DEFAULT_SEGMENT_BYTES, IN_PLACE_SEGMENT_BYTES, STRIPE_MIN_BYTES


@dataclass
class DaemonConfig:
    engine_id: str
    host: str = "127.0.0.1"
    grpc_port: int = 0
    data_port: int = 0
    metrics_port: int = 0  # 0 = pick a free port; -1 = no metrics endpoint
    advertise_host: str = ""  # what peers dial; defaults to host
    data_advertise_address: str = ""  # host:port peers dial for the data plane (behind NAT or a proxy)
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    in_place_segment_bytes: int = IN_PLACE_SEGMENT_BYTES  # over TCP where both sides hold the wire layout (nothing to pipeline)
    connections_per_peer: int = 4
    pull_timeout_seconds: float = 60.0  # a whole pull, queueing excluded
    stall_timeout_seconds: float = 10.0  # no byte from a peer for this long fails the read
    max_concurrent_pulls: int = 64  # more are queued (and kept alive by heartbeat)
    drain_seconds: float = 10.0
    drain_report_seconds: float = 5.0  # after draining, how long workers get to collect outcomes (from the newest)
    handshake_retries: int = 3
    # An engine not read from this long is forgotten: its handshake, the
    # same-host mappings of its memory, and the connections pooled to it.
    peer_idle_seconds: float = 300.0
    pull_retries: int = 2
    aggregator_address: str = ""  # the engine's aggregator daemon; empty: this one
    same_host: str = "auto"  # auto: copy directly between mapped regions when peers share a host; off: always TCP
    # Threads for a same-host copy and a relayout: on 2 cores two
    # process_vm_readv threads beat one memcpy (6.4 vs 5 GB/s measured), and
    # two threads relayout head rows at 0.95x one memcpy where one gets 0.5x.
    copy_threads: int = 2
    # A read of one remote rank of at least stripe_min_bytes goes over this many
    # data connections at once (loopback: 2 streams moved ~4.1 vs ~3.5 GB/s).
    stripes_per_read: int = 2
    stripe_min_bytes: int = STRIPE_MIN_BYTES
    log_format: str = "text"  # text: key=value lines; json: one JSON object a line
    log_level: str = "INFO"
    # Security (docs/security.md)
    auth: str = "none"  # none | token | mtls
    token_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    worker_api: str = "local"  # local: Worker RPCs only from loopback or the Unix socket; any: from anywhere
    worker_socket: str = ""  # also serve the Worker API on this Unix socket path
    max_segments_per_read: int = 65536
    max_pending_handshakes: int = 64
    # Params made before P's worker published (vLLM's scheduler hands them out
    # first): how long P waits for the publication when D resolves them.
    publish_wait_seconds: float = 10.0
    # Layer-wise streaming: how long a read of a streaming publication waits
    # for prefill to save its next layer (its worker died, or stalled) before
    # it fails. A streaming pull as a whole (prefill's compute included) is
    # bounded by pull_timeout_seconds.
    layer_wait_seconds: float = 30.0
    max_pending_resolves: int = 1024
    # Data plane backend: tcp (kvd's own), or nixl (NIXL/UCX moves the bytes;
    # control, leases and relayout stay kvd's). nixl needs `pip install 'kvd[nixl]'`.
    transport: str = "tcp"
    nixl_staging_bytes: int = 1 << 30  # per connection: gather staging for one NIXL read
    # How long NIXL's progress thread waits for a UCX event before it looks
    # anyway; 0 (NIXL's own) spins a core per daemon, idle or not. At 10 ms an
    # idle daemon used ~1% of a core, and reads moved as fast as at 0 over
    # shared memory and over UCX's TCP (benchmarks: kvd over NIXL, 128 MiB).
    nixl_progress_delay_us: int = 10_000
    # End-to-end verification (daemon/verifier.py): off, sampled (a few rows
    # of each block) or full (every row). As owner: digest what is published;
    # as reader: check what landed against the owner's digest.
    verify: str = "off"
    verify_keep_seconds: float = 60.0  # how long an owner keeps a publication's digests for its readers
    verify_full_fraction: float = 0.0  # with verify sampled: this share of requests is checked whole instead
    # Transfers ordered on the wire (core/qos.py): off, first come first served;
    # on, every read's segments by class, deadline and tenant. Tenants are
    # name=share pairs; naming any turns qos on.
    qos: str = "off"
    tenants: str = ""
    # With qos on, what a read moves between two looks at the wire's order:
    # what a read that arrives waits for, per chunk moving (1 MiB: 0.25 ms at 4 GB/s).
    qos_chunk_bytes: int = 1 << 20
    qos_slots: int = 2  # chunks of each lane (interactive; the rest) on the wire at once
    # With qos on, the most a TCP read moves: a bigger one is cut into more
    # reads (stripes), as D gives its connections to reads in the wire's
    # order and a read keeps its connection to its end. Tenants' 3:1 shares
    # over 3 s: 2.56-3.17 with 256 MiB reads, 2.96-2.99 with 64 MiB.
    qos_read_bytes: int = 64 << 20
    # With qos on, the threads that move reads of the classes below
    # interactive run this much above the daemon's nice value (0: at it), so
    # that on a host with few cores the interactive read's sends, receives
    # and handoffs come first (transport/thread_nice.py).
    qos_bulk_nice: int = 10

    @property
    def qos_on(self) -> bool:
        return self.qos == "on" or bool(self.tenants)

    @property
    def shares(self) -> dict[str, float]:
        """Each tenant's share of a contended wire (the unnamed tenant's: 1)."""
        return parse_shares(self.tenants)


ENV_PREFIX = "KVD_"

# Every *_seconds setting is a wait or a socket timeout. Past a day it is a
# mistake, and past about 1e11 a socket timeout raises (OverflowError): with
# stall_timeout_seconds=inf every read failed; drain_report_seconds=inf kept
# a stopping daemon from exiting.
MAX_SETTING_SECONDS = 86400.0

# key -> (check, what it must be)
_RULES: dict[str, tuple[Any, str]] = {
    "grpc_port": (lambda v: 0 <= v <= 65535, "a port in [0, 65535]"),
    "data_port": (lambda v: 0 <= v <= 65535, "a port in [0, 65535]"),
    "metrics_port": (lambda v: -1 <= v <= 65535, "a port in [0, 65535], or -1 for none"),
    "lease_seconds": (lambda v: 0 < v <= MAX_LEASE_SECONDS, f"in (0, {MAX_LEASE_SECONDS:g}]"),
    "segment_bytes": (lambda v: 4096 <= v <= 1 << 30, "in [4096, 1 GiB]"),
    "in_place_segment_bytes": (lambda v: 4096 <= v <= 1 << 30, "in [4096, 1 GiB]"),
    "connections_per_peer": (lambda v: 1 <= v <= 64, "in [1, 64]"),
    "pull_timeout_seconds": (lambda v: v > 0, "> 0"),
    "stall_timeout_seconds": (lambda v: v > 0, "> 0"),
    "max_concurrent_pulls": (lambda v: v >= 1, ">= 1"),
    "drain_seconds": (lambda v: v >= 0, ">= 0"),
    "drain_report_seconds": (lambda v: v >= 0, ">= 0"),
    "handshake_retries": (lambda v: v >= 1, ">= 1"),
    "peer_idle_seconds": (lambda v: v > 0, "> 0"),
    "pull_retries": (lambda v: v >= 0, ">= 0"),
    "same_host": (lambda v: v in ("auto", "off"), "auto or off"),
    "copy_threads": (lambda v: 1 <= v <= 64, "in [1, 64]"),
    "stripes_per_read": (lambda v: 1 <= v <= 64, "in [1, 64]"),
    "stripe_min_bytes": (lambda v: v >= 1, ">= 1"),
    "log_format": (lambda v: v in ("text", "json"), "text or json"),
    "auth": (lambda v: v in ("none", "token", "mtls"), "none, token or mtls"),
    "worker_api": (lambda v: v in ("local", "any"), "local or any"),
    "max_segments_per_read": (lambda v: 1 <= v <= 1 << 20, "in [1, 1048576]"),
    "max_pending_handshakes": (lambda v: v >= 1, ">= 1"),
    "publish_wait_seconds": (lambda v: v >= 0, ">= 0"),
    "layer_wait_seconds": (lambda v: v > 0, "> 0"),
    "max_pending_resolves": (lambda v: v >= 1, ">= 1"),
    "transport": (lambda v: v in ("tcp", "nixl"), "tcp or nixl"),
    "nixl_staging_bytes": (lambda v: 1 << 20 <= v <= 1 << 36, "in [1 MiB, 64 GiB]"),
    "nixl_progress_delay_us": (lambda v: 0 <= v <= 1_000_000, "in [0, 1000000]"),
    "verify": (lambda v: v in ("off", "sampled", "full"), "off, sampled or full"),
    "verify_keep_seconds": (lambda v: v > 0, "> 0"),
    "verify_full_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "qos": (lambda v: v in ("off", "on"), "off or on"),
    "tenants": (lambda v: _shares_ok(v), "name=share pairs with shares > 0, as in gold=3,silver=1"),
    "qos_chunk_bytes": (lambda v: 64 << 10 <= v <= 1 << 30, "in [64 KiB, 1 GiB]"),
    "qos_slots": (lambda v: 1 <= v <= 64, "in [1, 64]"),
    "qos_read_bytes": (lambda v: 1 << 20 <= v <= 1 << 40, "in [1 MiB, 1 TiB]"),
    "qos_bulk_nice": (lambda v: 0 <= v <= 19, "in [0, 19]"),
    "log_level": (lambda v: v.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "DEBUG, INFO, WARNING or ERROR"),
}


def _shares_ok(text: str) -> bool:
    try:
        parse_shares(text)
    except InvalidArgument:
        return False
    return True


class ConfigError(ValueError):
    """One line naming the key, the value and its source."""


def fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(DaemonConfig)}


def _coerce(key: str, raw: Any, source: str) -> Any:
    f = fields()[key]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={raw!r} (from {source}) is not a valid {kind}") from None


def load(path: str | None = None, env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Merge file < environment < flags into a validated DaemonConfig."""
    env = os.environ if env is None else env
    known = fields()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = path or env.get(f"{ENV_PREFIX}CONFIG") or None
    if path:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: must be a mapping of keys to values")
        for key, raw in data.items():
            key = str(key).replace("-", "_")
            if key not in known:
                raise ConfigError(f"{key} (from {path}) is not a config key; known: {', '.join(sorted(known))}")
            values[key], sources[key] = _coerce(key, raw, path), path
    for key in known:
        name = f"{ENV_PREFIX}{key.upper()}"
        if name in env:
            values[key], sources[key] = _coerce(key, env[name], name), name
    for key, raw in (flags or {}).items():
        if raw is not None and key in known:
            flag = "--" + key.replace("_", "-")
            values[key], sources[key] = _coerce(key, raw, flag), flag
    if not values.get("engine_id"):
        raise ConfigError("engine_id is required (config file, KVD_ENGINE_ID or --engine-id)")
    try:
        WorkerId(values["engine_id"])
    except InvalidArgument as e:
        raise ConfigError(f"engine_id={values['engine_id']!r} (from {sources['engine_id']}) {e.problem}") from None
    for key, value in values.items():
        rule = _RULES.get(key)
        if rule is not None and not rule[0](value):
            raise ConfigError(f"{key}={value!r} (from {sources[key]}) must be {rule[1]}")
        if key.endswith("_seconds") and not value <= MAX_SETTING_SECONDS:
            raise ConfigError(f"{key}={value!r} (from {sources[key]}) must be at most {MAX_SETTING_SECONDS:g} (a day)")
    for key in ("host", "advertise_host"):  # "[::]" as "::": the brackets belong to host:port text
        if key in values:
            values[key] = bare_host(values[key])
    config = DaemonConfig(**values)
    if config.transport == "nixl" and config.auth == "mtls":
        raise ConfigError(f"transport=nixl (from {sources.get('transport', 'default')}) cannot be used with auth=mtls "
                          f"(from {sources.get('auth', 'default')}): NIXL traffic is not encrypted")
    from kvd.auth import AuthConfig

    try:  # secrets are read now, so a bad file stops startup with one line
        AuthConfig.load(config.auth, config.token_file, config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    except InvalidArgument as e:
        raise ConfigError(f"{e.field}={e.value!r} (from {sources.get(e.field, 'config')}) {e.problem}") from None
    except OSError as e:
        raise ConfigError(f"TLS file: {e.filename}: {e.strerror}") from None
    return config


def describe(config: DaemonConfig) -> str:
    """The effective config, for ``kvd serve --print-config``."""
    import yaml

    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=True)

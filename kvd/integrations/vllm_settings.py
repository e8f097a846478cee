"""KvdConnector's settings, from vLLM's ``kv_connector_extra_config``:
read once, by the scheduler and by every worker, and checked then, so a bad
one stops the engine at startup with its key, not each request later."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvd.auth import AuthConfig
from kvd.core.leases import check_lease_seconds
from kvd.errors import KvdError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# How long a worker's idle step waits for the daemon to push an outcome
# (extra config ``kvd_idle_wait_ms``). vLLM keeps stepping while P holds a
# request for D (``has_finished_requests``), 1 ms apart, and every step wakes
# the TP workers, whose message queues spin on sched_yield for a second
# after each read: with a poll that costs 0.1 ms, P stepped 410-560 times a
# second and its workers took 95-99% of a core, and a decode rank sharing
# that core got none (hetero TP between OpenAI servers hung). Waiting 10 ms
# held idle steps to ~76 a second, the workers to 17%; a push ends the wait
# at once, so no outcome is later for it.
IDLE_WAIT_MS = 10.0


@dataclass(frozen=True)
class Settings:
    address: str
    advertise_address: str
    lease_seconds: float
    auth: AuthConfig
    idle_wait_seconds: float = IDLE_WAIT_MS / 1e3

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> Settings:
        kvt = vllm_config.kv_transfer_config
        extra: Mapping[str, Any] = dict(kvt.kv_connector_extra_config or {}) if kvt else {}
        address = str(extra.get("kvd_address", "127.0.0.1:50051"))
        auth = AuthConfig.load(str(extra.get("kvd_auth", "none")), str(extra.get("kvd_token_file", "")),
                               str(extra.get("kvd_tls_cert_file", "")), str(extra.get("kvd_tls_key_file", "")),
                               str(extra.get("kvd_tls_ca_file", "")))
        idle_wait_ms = float(extra.get("kvd_idle_wait_ms", IDLE_WAIT_MS))
        if not 0 <= idle_wait_ms <= 1000:
            raise KvdError(f"kv_connector_extra_config.kvd_idle_wait_ms={idle_wait_ms:g} must be in [0, 1000]")
        lease = check_lease_seconds("kv_connector_extra_config.kvd_lease_seconds", float(extra.get("kvd_lease_seconds", 0.0)))
        return cls(address, str(extra.get("kvd_advertise_address", address)), lease, auth, idle_wait_ms / 1e3)

"""Two emulated hosts for fault tests: network namespaces joined by a veth pair.

Each host gets its own namespace and one end of the pair (P at 10.77.0.1,
D at 10.77.0.2, a subnet that exists only between these two namespaces). A
daemon runs inside its host (``ip netns exec``) and binds there; the test's
workers stay in the test process and reach their daemon over its Unix worker
socket, which crosses network namespaces. Faults are what this kernel offers
(no netem, no tc actions here): the link taken down and up, and ``tbf`` to
shape it. Needs root; ``Hosts.create`` raises ``Unavailable`` with the reason
where namespaces cannot be made.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (the reason is the message)."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass
class Host:
    netns: str
    dev: str
    address: str

    @property
    def exec(self) -> list[str]:
        """The prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Hosts:
    prefill: Host
    decode: Host
    _flapper: threading.Thread | None = field(default=None, repr=False)
    _stop_flapping: threading.Event = field(default_factory=threading.Event, repr=False)
    flaps: int = 0

    @classmethod
    def create(cls) -> Hosts:
        tag = f"{os.getpid() % 100000}"
        hosts = cls(Host(f"kvdp{tag}", "vethp", "10.77.0.1"), Host(f"kvdd{tag}", "vethd", "10.77.0.2"))
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        try:
            for h in (hosts.prefill, hosts.decode):
                _ip("netns", "add", h.netns)
            _ip("link", "add", hosts.prefill.dev, "netns", hosts.prefill.netns, "type", "veth", "peer", "name", hosts.decode.dev,
                "netns", hosts.decode.netns)
            for h in (hosts.prefill, hosts.decode):
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.dev)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "link", "set", h.dev, "up")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            hosts.destroy()
            raise Unavailable(f"cannot make network namespaces: {e}") from None
        return hosts

    def link(self, up: bool) -> None:
        """Take the link down (a partition: nothing crosses, TCP retransmits) or up."""
        _ip("-n", self.decode.netns, "link", "set", self.decode.dev, "up" if up else "down")

    def shape(self, rate: str) -> None:
        """Shape both directions with a token bucket (``tbf``), e.g. ``10gbit``."""
        for h in (self.prefill, self.decode):
            r = subprocess.run(["tc", "-n", h.netns, "qdisc", "replace", "dev", h.dev, "root", "tbf", "rate", rate, "burst", "8mb",
                                "latency", "50ms"], capture_output=True, text=True, timeout=30)
            if r.returncode:
                raise RuntimeError(f"tc tbf on {h.dev}: {r.stderr.strip()}")

    def unshape(self) -> None:
        for h in (self.prefill, self.decode):
            subprocess.run(["tc", "-n", h.netns, "qdisc", "del", "dev", h.dev, "root"], capture_output=True, timeout=30)

    def start_flapping(self, seed: int, down_s: tuple[float, float] = (0.05, 0.3), up_s: tuple[float, float] = (0.2, 2.0)) -> None:
        """Down for 50-300 ms, up for 0.2-2 s, until ``stop_flapping``: real
        retransmissions and stalls, ending with the link up."""
        rng = random.Random(seed)

        def run() -> None:
            while not self._stop_flapping.is_set():
                self.link(False)
                self.flaps += 1
                time.sleep(rng.uniform(*down_s))
                self.link(True)
                self._stop_flapping.wait(rng.uniform(*up_s))

        self._stop_flapping.clear()
        self._flapper = threading.Thread(target=run, name="flapper", daemon=True)
        self._flapper.start()

    def stop_flapping(self) -> None:
        self._stop_flapping.set()
        if self._flapper is not None:
            self._flapper.join(timeout=10)
        self.link(True)

    def destroy(self) -> None:
        self._stop_flapping.set()
        for h in (self.prefill, self.decode):
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)


# A plain two-process socket transfer between the hosts: the reference kvd's
# throughput is read against (sendall / recv_into, 4 MiB buffers).
_SENDER = """
import socket, sys
n = int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = memoryview(bytearray(4 << 20))
while n:
    k = min(n, len(buf)); c.sendall(buf[:k]); n -= k
c.recv(1); c.close()
"""
_RECEIVER = """
import socket, sys, time
n = int(sys.argv[3]); c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = memoryview(bytearray(4 << 20))
t0 = time.perf_counter(); got = 0
while got < n:
    k = c.recv_into(buf, min(len(buf), n - got))
    if not k: raise SystemExit("short")
    got += k
print(time.perf_counter() - t0); c.sendall(b"x"); c.close()
"""


def plain_socket_seconds(hosts: Hosts, nbytes: int, python: str) -> float:
    """Seconds a plain socket takes to move ``nbytes`` from the prefill host to the decode host."""
    sender = subprocess.Popen([*hosts.prefill.exec, python, "-c", _SENDER, hosts.prefill.address, str(nbytes)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        port = sender.stdout.readline().strip()
        r = subprocess.run([*hosts.decode.exec, python, "-c", _RECEIVER, hosts.prefill.address, port, str(nbytes)],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"plain socket receiver: {r.stderr.strip()[-500:]}")
        return float(r.stdout.strip())
    finally:
        sender.wait(timeout=30)

"""``kvd serve`` as a subprocess: the one starter that tests, ``kvd demo``,
``kvd bench`` and ``benchmarks/`` use.

A daemon writes a ready file (its addresses, pid and version) once it
serves; ``DaemonProc.info`` waits for it on first use, so daemons started
together boot in parallel (most of a start is importing torch).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DaemonDidNotStart(RuntimeError):
    """The daemon exited, or wrote no ready file in time; the message holds its log."""


def parent_death_term() -> list[str]:
    """A command prefix under which a process gets SIGTERM when the thread
    that started it dies (Linux's parent-death signal, which survives exec):
    util-linux's ``setpriv``, where it is installed (else none: a SIGKILLed
    starter then leaves its daemons running, as before). Not preexec_fn,
    which may deadlock a process that has threads."""
    return list(_pdeathsig_prefix())


@functools.cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    # Tried once: setpriv before util-linux 2.33, and busybox's, have no --pdeathsig.
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    prefix = (setpriv, "--pdeathsig", "TERM", "--")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


@dataclass
class DaemonProc:
    """A started ``kvd serve``."""

    engine_id: str
    proc: subprocess.Popen[bytes]
    ready: Path
    log_path: Path
    current_tree: bool = True  # this checkout's kvd, not another release's (which may not handle SIGUSR1)
    ready_within: float = 60.0  # seconds of its own time: wall time less its wait for a CPU
    starved_within: float = 240.0  # seconds of wall time however starved
    _info: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        """The ready file's contents, waited for on first use: up to
        ``ready_within`` seconds of the daemon's own time, which is wall time
        less the time its main thread waited for a CPU. A daemon starved by
        busier processes (three of them on each core give it about 3% of
        one: two seconds of importing took more than 60) is not stuck, and
        one that sleeps or spins is still caught. A start starved past
        ``starved_within`` seconds of wall time fails all the same: a
        caller's own timeout would end it with no word of its state."""
        if self._info is None:
            started, waited_before = time.monotonic(), self.cpu_wait()
            while not self.ready.exists():
                if self.proc.poll() is not None:
                    raise DaemonDidNotStart(f"kvd serve for {self.engine_id} exited {self.proc.returncode}: {self.log()}")
                wall = time.monotonic() - started
                if wall - (self.cpu_wait() - waited_before) > self.ready_within or wall > self.starved_within:
                    # Stuck or busy: its state and CPU time, and where its threads are (in its log).
                    # The summary goes last too: a caller that keeps only a message's tail keeps it.
                    state = (f"kvd serve for {self.engine_id} not ready within {self.ready_within:g} s of its own time "
                             f"or {self.starved_within:g} s of wall time ({self.cpu()})")
                    self.stacks()
                    self.proc.kill()
                    raise DaemonDidNotStart(f"{state}: {self.log()}\n{state}")
                time.sleep(0.02)
            self._info = json.loads(self.ready.read_text())
        return self._info

    @property
    def grpc(self) -> str:
        return str(self.info["grpc"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics_url(self) -> str:
        return f"http://{self.info['metrics']}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cpu(self) -> str:
        """Its scheduler state, CPU seconds and seconds waiting for a CPU so far (``/proc``), as words."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError as e:
            return f"no /proc entry: {e}"
        user, system = (int(f) / os.sysconf("SC_CLK_TCK") for f in fields[11:13])
        return f"state {fields[0]}, {user:.2f} s user and {system:.2f} s system CPU since it started, its main thread {self.cpu_wait():.2f} s waiting for a CPU"

    def cpu_wait(self) -> float:
        """Seconds its main thread has spent runnable but waiting for a CPU
        (``run_delay``); 0 where the kernel does not keep it, or it is gone."""
        return run_delay(self.proc.pid) or 0.0

    def stacks(self, wait: float = 1.0) -> str:
        """Every thread's stack, as the daemon writes it to its log on SIGUSR1
        (even a daemon no Python thread of which can run, or one still
        importing), or why there are none: for a test's failure message, as
        CI keeps no files. Only for a daemon of this tree: an older release
        may not handle SIGUSR1, which would end it."""
        if not self.current_tree:
            return f"(kvd serve for {self.engine_id} runs another release: no stacks asked)"
        if self.proc.poll() is not None:
            return f"(kvd serve for {self.engine_id} exited {self.proc.returncode})"
        before = len(self.log())
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(wait)
        return self.log()[before:] or f"(kvd serve for {self.engine_id} wrote no stacks within {wait}s of SIGUSR1)"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal it (SIGTERM: drain and exit) and wait for its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_delay(pid: int) -> float | None:
    """Seconds process ``pid``'s main thread has spent runnable but waiting
    for a CPU (``/proc/PID/schedstat``'s second field); None where the
    kernel keeps none (no CONFIG_SCHED_INFO), or the process is gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def start_daemon(engine_id: str, folder: Path, *extra: str, name: str = "", grpc_port: int = 0, prefix: Sequence[str] = (),
                 source: Path | None = None, with_parent: bool = False) -> DaemonProc:
    """Start ``kvd serve`` for ``engine_id``, its ready file and log in
    ``folder`` (as ``name``.json and .log; the engine id by default), every
    port chosen by the kernel but gRPC's when ``grpc_port`` is set.
    ``extra`` flags come last, so they override these. ``prefix`` runs it
    elsewhere (inside a network namespace); ``source`` is the kvd tree it
    runs (another release's checkout), this interpreter's by default.
    ``with_parent``: the daemon drains and exits (SIGTERM) when the thread
    that starts it dies, however it dies (``kill -9`` of ``kvd demo``).
    Returns at once: ``info`` waits for it."""
    name = name or engine_id
    prefix = [*prefix, *(parent_death_term() if with_parent else ())]
    ready, log_path = folder / f"{name}.json", folder / f"{name}.log"
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvd", "serve", "--engine-id", engine_id, "--grpc-port", str(grpc_port), "--data-port", "0",
             "--metrics-port", "0", "--ready-file", str(ready), *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=source,
            env={**os.environ, "PYTHONPATH": str(source)} if source is not None else None,
        )
    return DaemonProc(engine_id, proc, ready, log_path, current_tree=source is None)

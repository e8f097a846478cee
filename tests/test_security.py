"""Only the right peers, only the published blocks, every bad input refused."""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.auth import AuthConfig, is_local_peer
from kvd.client import KvdClient, daemon_status
from kvd.core.errors import PermissionDenied
from kvd.core.spec import WorkerId
from kvd.core.wire import HEADER, MAGIC, VERSION, FrameType
from kvd.daemon.caller_uid import CallerUnlisted, tcp_caller_uid
from kvd.daemon.sock_diag import (
    ESTABLISHED,
    LISTEN,
    LIVE_STATES,
    TIME_WAIT,
    TcpSocket,
    port_filter,
    tcp_sockets,
)
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from kvd.regions.shm import ShmRegion
from tests.conftest import REPO, make_worker
from tests.rawpeer import RawPeer, fake_engine, handshake

pytestmark = pytest.mark.security


def write_secret(path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def check_transfer(pw, dw, rid: str, seed: int) -> None:
    pw.fill(seed, [1, 2])
    params = pw.client.publish(rid, [[1, 2]], 32)
    dw.client.pull(rid, params, [[3, 4]])
    f = dw.client.wait_finished(recving={rid}, timeout=30)
    assert f.details[("recving", rid)].outcome == "done", f.details[("recving", rid)].reason
    assert dw.mismatch(seed, [3, 4], 32) is None


# ---------------------------------------------------------------- token mode


@pytest.fixture
def token_daemons(daemons, tmp_path):
    token = secrets.token_hex(32).encode()
    path = write_secret(tmp_path / "token", token)
    p = daemons.start("prefill", "--auth", "token", "--token-file", path)
    d = daemons.start("decode", "--auth", "token", "--token-file", path)
    auth = AuthConfig("token", token=token)
    pw, dw = make_worker(p.grpc, "prefill", auth=auth), make_worker(d.grpc, "decode", auth=auth)
    return p, d, pw, dw, token


def test_token_mode_serves_the_right_peers_and_refuses_the_rest(token_daemons):
    p, _d, pw, dw, _token = token_daemons
    check_transfer(pw, dw, "ok", 1)
    for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
        with grpc.insecure_channel(p.grpc) as ch, pytest.raises(grpc.RpcError) as e:
            pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(p.grpc) as ch, pytest.raises(grpc.RpcError) as e:
            pbg.PeerStub(ch).Handshake(pb.HandshakeRequest(caller=fake_engine()), timeout=5, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # kubelet probes carry no token: health stays open
    with grpc.insecure_channel(p.grpc) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_token_mode_data_plane_closes_without_the_token_before_any_kv(token_daemons):
    p, _d, pw, _dw, token = token_daemons
    data_token = handshake(p.grpc, fake_engine("reader"), (("authorization", "Bearer " + token.decode()),)).data_token
    pw.fill(3, [1, 2])
    params = pw.client.publish("r", [[1, 2]], 32)
    for shared in (b"", b"not-the-token-at-all"):
        raw = RawPeer(p.info["data"])
        ftype, body = raw.hello("reader", "e1", data_token, shared)
        assert ftype is FrameType.ERROR and b"UNAUTHENTICATED" in body
        read = pb.DataRead(owner_engine_id="prefill", request_id="r", generation=params.generation, capability=params.capability, head_count=4)
        read.segments.add(group_id=0, layers=[0], block_start=1, block_count=2, token_count=16)
        with pytest.raises((ConnectionError, OSError)):
            raw.send(FrameType.READ, read.SerializeToString())
            raw.recv_frame()  # the daemon closed the connection: no DATA ever comes
        raw.close()


def test_a_readable_token_file_is_refused(tmp_path, daemons):
    path = write_secret(tmp_path / "token", secrets.token_hex(32).encode(), mode=0o644)
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "p", "--auth", "token", "--token-file", path],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "token_file" in r.stderr and "0o644" in r.stderr
    with open(path) as f:
        assert f.read() not in r.stderr  # never echo a secret


# ---------------------------------------------------------------- mutual TLS


@pytest.fixture
def pki(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca, other = trustme.CA(), trustme.CA()
    files = {}
    for name, authority in (("good", ca), ("rogue", other)):
        cert = authority.issue_cert("127.0.0.1", "localhost")
        files[name] = (
            str(tmp_path / f"{name}.pem"),
            write_secret(tmp_path / f"{name}.key", cert.private_key_pem.bytes()),
        )
        (tmp_path / f"{name}.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    return files, str(tmp_path / "ca.pem")


def test_mtls_serves_certified_peers_only_on_both_planes(daemons, pki):
    files, ca = pki
    cert, key = files["good"]
    flags = ("--auth", "mtls", "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-file", ca)
    p, d = daemons.start("prefill", *flags), daemons.start("decode", *flags)
    auth = AuthConfig.load("mtls", cert_file=cert, key_file=key, ca_file=ca)
    pw, dw = make_worker(p.grpc, "prefill", auth=auth), make_worker(d.grpc, "decode", auth=auth)
    check_transfer(pw, dw, "ok", 7)
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    root = read(ca)
    rogue_cert, rogue_key = files["rogue"]
    attempts = {
        "no certificate": grpc.ssl_channel_credentials(root_certificates=root),
        "wrong certificate": grpc.ssl_channel_credentials(root_certificates=root, private_key=read(rogue_key), certificate_chain=read(rogue_cert)),
    }
    for what, creds in attempts.items():
        with grpc.secure_channel(p.grpc, creds) as ch, pytest.raises(grpc.RpcError) as e:
            pbg.PeerStub(ch).Handshake(pb.HandshakeRequest(caller=fake_engine()), timeout=5)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED), what
    with grpc.insecure_channel(p.grpc) as ch, pytest.raises(grpc.RpcError):
        pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)  # plaintext gets nowhere
    # The data plane speaks TLS too: a plaintext peer is cut off before any frame.
    raw = RawPeer(p.info["data"])
    with pytest.raises((ConnectionError, OSError)):
        raw.hello("decode", "guessed-epoch", secrets.token_bytes(32))
    raw.close()


# ---------------------------------------------------------------- least privilege


def test_only_the_registered_worker_acts_for_its_rank(daemons):
    p = daemons.start("prefill")
    owner = make_worker(p.grpc, "prefill", tp_rank=0, tp_size=2)
    other = make_worker(p.grpc, "prefill", tp_rank=1, tp_size=2)
    impostor = KvdClient(p.grpc, WorkerId("prefill", 0, 2))  # never registered: no token
    with pytest.raises(PermissionDenied, match="only the registered worker"):
        impostor.publish("r", [[1]], 16)
    # rank 1's token does not open rank 0
    impostor.worker_token = other.client.worker_token
    for call in (lambda: impostor.publish("r", [[1]], 16), lambda: impostor.abort("r"), impostor.get_finished,
                 lambda: next(impostor.watch_finished())):
        with pytest.raises(PermissionDenied):
            call()
    assert owner.client.publish("r", [[1]], 16).generation > 0


def test_local_peer_detection():
    assert is_local_peer("ipv4:127.0.0.1:5555") and is_local_peer("unix:/tmp/kvd.sock") and is_local_peer("ipv6:[::1]:80")
    assert not is_local_peer("ipv4:10.1.2.3:5555") and not is_local_peer("ipv6:[fe80::1]:80")


NOBODY = 65534
# A worker of another user (it drops root once imported: the interpreter may live where only root reads) that
# registers its own memory, after trying to name another user's file.
_NOBODY_WORKER = """
import os, sys
from kvd import caches
from kvd.client import daemon_status
from tests.conftest import make_worker
make_worker(sys.argv[1], "warm-up", register=False).client.close()  # every import, while the interpreter's files are readable
caches.release_all()
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[3]))  # from here on another user: its shm files and its connections are that user's
w = make_worker(sys.argv[1], "prefill", register=False)
own = [(r, r.name) for r in caches._REGIONS.values()]
for r, _ in own:
    r.name = sys.argv[2]  # its registration names the other user's file instead of its own
try:
    w.register()
    print("REGISTERED the other user's file")
except Exception as e:
    print("REFUSED", type(e).__name__, e)
for r, name in own:
    r.name = name
mine = caches.alive_token
caches.alive_token = lambda: sys.argv[2]  # its alive token names the other user's file (the daemon would watch, then remove it)
try:
    w.register()
    print("TOKEN REGISTERED the other user's file")
except Exception as e:
    print("TOKEN REFUSED", type(e).__name__, e)
caches.alive_token = mine
w.register()
print("OWN MEMORY REGISTERED")
# Counted here, while this worker lives: once it exits, the daemon's reaper retires its registration.
print("WORKERS", len(daemon_status(sys.argv[1]).workers))
"""


def _host_address() -> str | None:
    """One of this host's own addresses that is not loopback (None where it has none)."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return next((w.split("/")[0] for line in out.splitlines() for w in line.split()[3:4] if not w.startswith("127.")), None)


def _reusing(local: tuple[str, int], remote: tuple[str, int], family: int = socket.AF_INET) -> socket.socket:
    """A client socket on ``local`` with SO_REUSEADDR, which gRPC's clients set too: any user may so share an address and port."""
    s = socket.socket(family)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(local)
    s.connect(remote)
    return s


def _until_refused(lookup: Callable[[], object], within: float = 5.0) -> None:
    """``lookup`` until it raises (an RST arrives a moment after the close that sends it)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        lookup()
        time.sleep(0.01)


def test_a_callers_uid_is_read_from_the_kernels_table_as_one_exact_connection():
    """The caller's own socket, paired with this process's accepted end: from 127.0.0.1, another loopback
    address, an AF_INET6 socket on an IPv4-mapped one (gRPC names that peer ipv4:), and this host's own
    address. A second socket on the first one's address and port (SO_REUSEADDR), connected to another of
    our addresses, makes the pair ambiguous: refused. Negative control: matched by the caller's address
    and a loopback far end (8db8dd3), that second socket's row was dropped and the lookup answered the
    first one's uid (a user, so, registered root's file through a daemon on 0.0.0.0)."""
    host = _host_address()
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    clients = [_reusing(("127.0.0.1", 0), ("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0)),
               _reusing(("::ffff:127.0.0.2", 0), ("::ffff:127.0.0.1", port), socket.AF_INET6)]
    if host:
        clients.append(socket.create_connection((host, port)))
    accepted = [server.accept()[0] for _ in clients]
    try:
        for c in clients:
            addr, cport = c.getsockname()[:2]
            assert tcp_caller_uid(f"ipv4:{addr.removeprefix('::ffff:')}:{cport}", port) == os.geteuid()
        with pytest.raises(CallerUnlisted, match="0 of this daemon's sockets"):  # no connection to that port
            tcp_caller_uid(f"ipv4:127.0.0.1:{clients[0].getsockname()[1]}", port ^ 1)
        assert tcp_caller_uid("unix:", port) is None  # the socket file's permissions decide
        # A connection reset by its far end leaves the table while our end is open: whose it was is not
        # known (a twin may ask and reset at once), so every caller is refused until our end is closed.
        reset = socket.create_connection(("127.0.0.1", port))
        reset_accepted = server.accept()[0]
        accepted.append(reset_accepted)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        with pytest.raises(CallerUnlisted, match="was reset"):
            _until_refused(lambda: tcp_caller_uid(f"ipv4:127.0.0.1:{clients[0].getsockname()[1]}", port))
        reset_accepted.close()
        assert tcp_caller_uid(f"ipv4:127.0.0.1:{clients[0].getsockname()[1]}", port) == os.geteuid()
        if host is None:
            pytest.skip("this host has no address but loopback: no second way in")
        twin = _reusing(clients[0].getsockname(), (host, port))
        accepted.append(server.accept()[0])
        with pytest.raises(CallerUnlisted, match="2 of this daemon's sockets"):
            tcp_caller_uid(f"ipv4:127.0.0.1:{clients[0].getsockname()[1]}", port)
        twin.close()
    finally:
        for c in [*clients, *accepted, server]:
            c.close()


FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT = 4, 5, 8  # the kernel's TCP_* numbers


def test_sock_diag_lists_exactly_the_live_sockets_on_the_port_once_each_while_others_come_and_go():
    """The dump returns our listener, its accepted socket and the caller's end, each once: not the
    TIME_WAIT end of an ended connection, not sockets on other ports; and a fresh pair is listed once
    on each side while connections elsewhere come and go. /proc/net/tcp, which the lookup read up to
    d1cb86c, listed such a pair's end twice in 2 of 653 lookups under the same churn (27 times once),
    and refused a real worker ('its end is listed 2 times') in CI; it may as well skip a twin."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = server.getsockname()[1]
    elsewhere = socket.create_server(("127.0.0.1", 0), backlog=64)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            c = socket.create_connection(elsewhere.getsockname())
            elsewhere.accept()[0].close()
            c.close()

    client = socket.create_connection(("127.0.0.1", port))
    accepted = server.accept()[0]
    ended = socket.create_connection(("127.0.0.1", port))
    ended_port = ended.getsockname()[1]
    ended.close()  # it closes first: its end waits in TIME_WAIT
    server.accept()[0].close()
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        rows = tcp_sockets(port, client.getsockname()[1])
        inode = {s: os.fstat(s.fileno()).st_ino for s in (server, accepted, client)}
        assert sorted(r.inode for r in rows) == sorted(inode.values())
        assert {r.state for r in rows} == {LISTEN, ESTABLISHED}
        assert next(r for r in rows if r.inode == inode[client]).remote[1] == port
        assert sorted(r.inode for r in tcp_sockets(port, ended_port)) == sorted((inode[server], inode[accepted]))  # not TIME_WAIT
        assert {r.local[1] for r in tcp_sockets(elsewhere.getsockname()[1], 1)} == {elsewhere.getsockname()[1]}
        orphan = socket.create_connection(("127.0.0.1", port))
        orphan_port = orphan.getsockname()[1]
        accepted_too = server.accept()[0]
        orphan.close()  # its FIN taken, our end kept open: an orphan in FIN_WAIT2, held by no process
        # The orphan is listed by its substate (FIN_WAIT2, inode 0: 'its end is closed'), as /proc listed it.
        def orphan_rows() -> list[tuple[int, int]]:
            return [(r.state, r.inode) for r in tcp_sockets(port, orphan_port) if r.local[1] == orphan_port]
        deadline = time.monotonic() + 5
        while orphan_rows() == [(FIN_WAIT1, 0)] and time.monotonic() < deadline:  # its FIN not yet acknowledged
            time.sleep(0.01)
        assert orphan_rows() == [(FIN_WAIT2, 0)]
        accepted_too.close()
        counts = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", port))
            a = server.accept()[0]
            cp = c.getsockname()[1]
            found = tcp_sockets(port, cp)
            counts.append((sum(r.remote[1] == cp for r in found), sum(r.local[1] == cp for r in found)))
            c.close()
            a.close()
        assert set(counts) == {(1, 1)}
    finally:
        stop.set()
        thread.join()
        for s in (client, accepted, server, elsewhere):
            s.close()


def test_the_port_filter_is_bytecode_the_kernel_accepts_and_runs():
    """Each op is (code, yes, no, jumps in bytes); the kernel refuses a chain whose ``yes`` jumps skip an
    op. Negative control: a filter that jumps straight to the end on a match (skipping the JMP) is refused."""
    bytecode = port_filter(8080, 40960)
    assert len(bytecode) == 28 and struct.unpack_from("=BBH", bytecode, 8) == (1, 4, 20)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as nl:
        bad = struct.pack("=BBH", 11, 28, 12) + bytecode[4:]  # S_EQ whose yes jumps over the rest
        request = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, LIVE_STATES) + bytes(48)
        body = request + struct.pack("=HH", 4 + len(bad), 1) + bad
        nl.sendall(struct.pack("=IHHII", 16 + len(body), 20, 0x301, 1, 0) + body)
        reply = nl.recv(4096)
        assert struct.unpack_from("=H", reply, 4)[0] == 2 and struct.unpack_from("=i", reply, 16)[0] == -22  # NLMSG_ERROR, EINVAL


# The kernel's TCP sockets, by hand: a daemon listening on port 8080 of 127.0.0.1, of 192.0.2.2 and of
# ::1, whose own sockets are the inodes _OURS; root's workers, and nobody's sockets that reuse their ports
# (other loopback addresses, SO_REUSEADDR). The state is what sock_diag reports (a timewait socket's substate).
_SOCKETS = [
    ("127.0.0.1:8080", "0.0.0.0:0", 0, 1, LISTEN), ("192.0.2.2:8080", "0.0.0.0:0", 0, 6, LISTEN),  # our listeners
    ("[::1]:8080", "[::]:0", 0, 8, LISTEN),
    ("127.0.0.1:8080", "127.0.0.1:40960", 0, 2), ("127.0.0.1:40960", "127.0.0.1:8080", 0, 102),  # root's worker
    ("[::1]:8080", "[::1]:40960", 0, 7), ("[::1]:40960", "[::1]:8080", 0, 107),  # ... and over IPv6
    ("127.0.0.1:8080", "127.0.0.2:40960", 0, 3), ("127.0.0.2:40960", "127.0.0.1:8080", NOBODY, 103),  # its port on 127.0.0.2
    ("127.0.0.1:8080", "127.0.0.3:8080", 0, 4), ("127.0.0.3:8080", "127.0.0.1:8080", NOBODY, 104),  # our port on 127.0.0.3
    ("127.0.0.1:8080", "127.0.0.4:8080", 0, 5), ("127.0.0.4:8080", "127.0.0.1:8080", NOBODY, 105),  # ... from an IPv4-mapped socket
    ("127.0.0.1:8080", "127.0.0.1:45056", 0, 20), ("127.0.0.1:45056", "127.0.0.1:8080", 0, 120),  # root's worker ...
    ("192.0.2.2:8080", "127.0.0.1:45056", 0, 21), ("127.0.0.1:45056", "192.0.2.2:8080", NOBODY, 121),  # ... and its twin to 192.0.2.2
    ("127.0.0.1:8080", "127.0.0.1:49152", 0, 30), ("127.0.0.1:49152", "127.0.0.1:8080", 0, 130),  # root's worker ...
    ("127.0.0.2:8080", "0.0.0.0:0", NOBODY, 32, LISTEN),  # ... nobody's listener on 127.0.0.2 ...
    ("127.0.0.2:8080", "127.0.0.1:49152", NOBODY, 31), ("127.0.0.1:49152", "127.0.0.2:8080", NOBODY, 131),  # ... and a twin to it
    ("192.0.2.2:8080", "10.0.0.5:53248", 0, 40),  # a worker on 10.0.0.5, another host
    ("192.0.2.2:8080", "192.0.2.2:57344", 0, 41), ("192.0.2.2:57344", "192.0.2.2:8080", NOBODY, 141),  # nobody via this host's address
    ("127.0.0.1:8080", "127.0.0.9:40960", 0, 50),  # a loopback peer whose end is not listed
    ("127.0.0.1:8080", "127.0.0.6:45056", 0, 60), ("127.0.0.6:45056", "127.0.0.1:8080", NOBODY, 160), ("127.0.0.6:45056", "127.0.0.1:8080", 0, 161),
    # root's worker, and a twin to 192.0.2.2 that asked and half-closed (CLOSE_WAIT on our side) ...
    ("127.0.0.1:8080", "127.0.0.1:61440", 0, 70), ("127.0.0.1:61440", "127.0.0.1:8080", 0, 170),
    ("192.0.2.2:8080", "127.0.0.1:61440", 0, 71, CLOSE_WAIT), ("127.0.0.1:61440", "192.0.2.2:8080", NOBODY, 171, FIN_WAIT2),
    # ... twins ended both ways (TIME_WAIT, held by no process: uid 0), ours gone: ended calls, not callers ...
    ("127.0.0.1:8080", "127.0.0.1:61696", 0, 72), ("127.0.0.1:61696", "127.0.0.1:8080", 0, 172),
    ("127.0.0.1:61696", "192.0.2.2:8080", 0, 0, TIME_WAIT), ("192.0.2.2:8080", "127.0.0.1:61696", 0, 0, TIME_WAIT),
    # ... a twin not yet accepted (our end held by no process yet) ...
    ("127.0.0.1:8080", "127.0.0.1:61952", 0, 73), ("127.0.0.1:61952", "127.0.0.1:8080", 0, 173),
    ("192.0.2.2:8080", "127.0.0.1:61952", 0, 0), ("127.0.0.1:61952", "192.0.2.2:8080", NOBODY, 174),
    # ... a caller that closed its end after asking, its FIN not yet taken (FIN_WAIT1, no process: uid 0) ...
    ("127.0.0.1:8080", "127.0.0.7:40960", 0, 74), ("127.0.0.7:40960", "127.0.0.1:8080", 0, 0, FIN_WAIT1),
    # ... and one whose FIN was taken: an orphan in FIN_WAIT2 (a timewait socket, listed by its substate)
    ("127.0.0.1:8080", "127.0.0.10:40960", 0, 75, CLOSE_WAIT), ("127.0.0.10:40960", "127.0.0.1:8080", 0, 0, FIN_WAIT2),
    # noise the filter leaves out: other ports, and our port as someone else's far end only
    ("127.0.0.1:9090", "127.0.0.1:40960", 0, 90), ("127.0.0.5:33333", "127.0.0.1:8080", NOBODY, 91),
]
_OURS = {1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 30, 40, 41, 50, 60, 70, 71, 72, 73, 74, 75}


def _endpoint(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, _, port = text.rpartition(":")
    return ipaddress.ip_address(host.strip("[]")), int(port)


def _dump(port: int, other: int) -> list[TcpSocket]:
    """What sock_diag returns for ``_SOCKETS``: its state mask and port filter, as the kernel applies them."""
    found = []
    for local, remote, uid, inode, state in ((*r, ESTABLISHED)[:5] for r in _SOCKETS):
        s = TcpSocket(_endpoint(local), _endpoint(remote), state, uid, inode)
        if LIVE_STATES >> state & 1 and (s.local[1] == port or (s.local[1] == other and s.remote[1] == port)):
            found.append(s)
    return found


def test_a_caller_on_another_users_address_and_port_is_still_itself():
    """Any user may bind another loopback address to the port a root worker, or the daemon, uses on
    127.0.0.1, or share root's very address and port (SO_REUSEADDR) towards another of our addresses, or
    towards a listener of its own; and it may half-close, close or reset that twin right after asking.
    Negative controls: matched by ports alone (6b5e4a2), nobody's connections found root (uid 0); by the
    caller's address and a loopback far end (8db8dd3), the twin to 192.0.2.2 found root's, and the twin to
    nobody's listener made root's own registration fail; by established rows alone (5eb9314), the
    half-closed and not yet accepted twins found root's (uid 0). A twin that has ended both ways
    (TIME_WAIT, a minute) may not block root's registrations: counting it refused them."""

    def uid(peer: str) -> int | None:
        return tcp_caller_uid(peer, 8080, _dump, lambda: dict.fromkeys(_OURS, -1))

    assert uid("ipv4:127.0.0.1:40960") == 0  # root's worker
    assert uid("ipv6:%5B::1%5D:40960") == 0
    assert uid("ipv4:127.0.0.2:40960") == NOBODY  # root worker's port, another address
    assert uid("ipv4:127.0.0.3:8080") == NOBODY  # the daemon's own port
    assert uid("ipv6:%5B::ffff:127.0.0.4%5D:8080") == NOBODY  # the same from an IPv4-mapped socket
    with pytest.raises(CallerUnlisted, match="2 of this daemon's sockets"):  # root's address and port, twice
        uid("ipv4:127.0.0.1:45056")
    assert uid("ipv4:127.0.0.1:49152") == 0  # a twin to a listener of nobody's own changes nothing
    assert uid("ipv4:10.0.0.5:53248") is None  # another host's: not known
    assert uid("ipv4:192.0.2.2:57344") == NOBODY  # a local user on this host's own address is known
    with pytest.raises(CallerUnlisted, match="listed 0 times"):  # loopback, its end not found: refused, not let through
        uid("ipv4:127.0.0.9:40960")
    with pytest.raises(CallerUnlisted, match="listed 2 times"):
        uid("ipv4:127.0.0.6:45056")
    with pytest.raises(CallerUnlisted, match="0 of this daemon's sockets"):  # not connected to us at all
        uid("ipv4:127.0.0.8:40960")
    with pytest.raises(CallerUnlisted, match="2 of this daemon's sockets"):  # a twin half-closed
        uid("ipv4:127.0.0.1:61440")
    # Twins that ended both ways (TIME_WAIT: gRPC has closed our end and cancelled their calls) block no one.
    assert uid("ipv4:127.0.0.1:61696") == 0
    with pytest.raises(CallerUnlisted, match="2 of this daemon's sockets"):  # a twin not yet accepted
        uid("ipv4:127.0.0.1:61952")
    with pytest.raises(CallerUnlisted, match="its end is closed"):  # the caller's own end, closed
        uid("ipv4:127.0.0.7:40960")
    with pytest.raises(CallerUnlisted, match="its end is closed"):  # ... and its FIN taken (an orphan in FIN_WAIT2)
        uid("ipv4:127.0.0.10:40960")


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a worker as another user needs root")
def test_a_worker_registers_only_its_own_shared_memory(daemons, tmp_path):
    """Any local user reaches the worker API on loopback, and the daemon opens what a registration names
    with its own rights: naming another user's /dev/shm file (another tenant's KV cache, mode 600) would
    let them read it through a publication, or overwrite it through a pull. Negative control: without
    the check, the file is registered."""
    p = daemons.start("prefill")
    victim = ShmRegion.create(16 << 20)  # root's, mode 600
    try:
        victim.tensor.fill_(0x5A)
        r = subprocess.run([sys.executable, "-c", _NOBODY_WORKER, p.grpc, victim.name, str(NOBODY)], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        refused = next(line for line in r.stdout.splitlines() if line.startswith(("REFUSED", "REGISTERED")))
        assert refused.startswith("REFUSED PermissionDenied"), r.stdout
        assert f"={victim.name!r} belongs to uid 0, not to the registering worker's uid {NOBODY}" in refused, refused
        token = next(line for line in r.stdout.splitlines() if line.startswith("TOKEN"))
        assert token.startswith("TOKEN REFUSED PermissionDenied") and f"alive_shm={victim.name!r} belongs to uid 0" in token, token
        assert "OWN MEMORY REGISTERED" in r.stdout, r.stdout  # the same user's own memory: served
        assert "WORKERS 1" in r.stdout, r.stdout  # the refused registration left nothing behind
        assert bool((victim.tensor == 0x5A).all())
    finally:
        victim.close()


# ---------------------------------------------------------------- capability-scoped reads


def test_reads_need_the_capability_for_exactly_those_blocks_and_that_reader(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    dw.fill(99, [3, 4])  # sentinel: nothing refused may overwrite it

    def refused(params, why: str) -> None:
        rid = params.request_id
        dw.client.pull(rid, params, [[3, 4]])
        f = dw.client.wait_finished(recving={rid}, timeout=30)
        assert f.details[("recving", rid)].outcome == "failed", why
        assert dw.mismatch(99, [3, 4], 32) is None, why

    pw.fill(1, [1, 2])
    params = pw.client.publish("a", [[1, 2]], 32)
    no_cap = pb.TransferParams()
    no_cap.CopyFrom(params)
    no_cap.capability = b""
    refused(no_cap, "no capability")
    # A failed reader tells P to let go, but without the capability that ends nothing.
    time.sleep(0.5)
    assert "a" in {x.request_id for x in daemon_status(p.grpc).leases}
    other_blocks = pb.TransferParams()
    other_blocks.CopyFrom(params)
    other_blocks.block_ids[0].ids[:] = [5, 6]
    refused(other_blocks, "a capability for other blocks")
    # Its holder failed to load: it released the publication, and a replay finds nothing.
    assert pw.client.wait_finished(sending={"a"}, timeout=10).finished_sending == {"a"}
    refused(params, "replayed after its reader released it")
    params = pw.client.publish("a2", [[1, 2]], 32)
    assert pw.client.abort("a2")
    refused(params, "replayed after abort")
    bound = pw.client.publish("b", [[1, 2]], 32, reader_engine_id="somebody-else")
    refused(bound, "a capability for another engine")
    short = pw.client.publish("c", [[1, 2]], 32, lease_seconds=0.2)
    pw.client.wait_finished(sending={"c"}, timeout=10)
    refused(short, "replayed after expiry")


def _read_all(raw: RawPeer) -> tuple[FrameType, int, bytes]:
    """A read's frames up to its END or ERROR: (the last type, payload bytes before it, its body)."""
    total = 0
    while True:
        ftype, _, body = raw.recv_frame()
        if ftype in (FrameType.END, FrameType.ERROR):
            return ftype, total, body
        total += len(body)


@pytest.mark.parametrize(("case", "why"), [
    ("layers", b"segment.layers"), ("blocks", b"read.segments"), ("segments", b"read.segments"), ("halves", b"read.segments")])
def test_a_read_asking_for_bytes_twice_is_refused_not_served_again_and_again(daemons, case, why):
    """A READ frame holds up to 500k layer positions, or some 40k segments:
    before, each was served in full, so one read of a 64 KiB publication
    listing its 4 layers 10,000 times had the owner send 655 MB (measured);
    block ids or whole segments repeated did the same."""
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill", layers=4, heads=4)
    data_token = handshake(p.grpc, fake_engine("reader", layers=4, heads=4)).data_token
    pw.fill(1, [1, 2, 3, 4])
    whole = dict(group_id=0, layers=[0, 1, 2, 3], block_count=4, token_count=16, kv_count=2, head_count=4, block_ids=[1, 2, 3, 4])
    asks = {"layers": [{**whole, "layers": [0, 1, 2, 3] * 10_000}], "blocks": [{**whole, "block_ids": [1, 2, 3, 4] * 4}],
            "segments": [whole] * 3, "halves": [{**whole, "token_count": 9}, {**whole, "token_start": 7, "token_count": 9}]}
    served = {}
    for name, segments in (("whole", [whole]), ("halves-apart", [{**whole, "token_count": 8}, {**whole, "token_start": 8, "token_count": 8}]),
                           (case, asks[case])):
        params = pw.client.publish(name, [[1, 2, 3, 4]], 64)
        read = pb.DataRead(owner_engine_id="prefill", request_id=name, generation=params.generation, capability=params.capability, head_count=4)
        for seg in segments:
            read.segments.add(**seg)
        raw = RawPeer(p.info["data"])
        try:
            assert raw.hello("reader", "e1", data_token)[0] is FrameType.HELLO_OK
            raw.send(FrameType.READ, read.SerializeToString())
            served[name] = _read_all(raw)
        finally:
            raw.close()
    nbytes = 4 * 4 * 16 * 4 * 16 * 2 * 2  # layers x blocks x tokens x heads x dim x K,V x bf16: the publication, once
    assert served["whole"][:2] == served["halves-apart"][:2] == (FrameType.END, nbytes)
    ftype, sent, body = served[case]
    assert (ftype, sent) == (FrameType.ERROR, 0) and b"INVALID_ARGUMENT" in body and why in body, body


# ---------------------------------------------------------------- fuzzing


METHODS = [
    "/kvd.v1.Worker/Register", "/kvd.v1.Worker/Publish", "/kvd.v1.Worker/Pull", "/kvd.v1.Worker/Abort",
    "/kvd.v1.Worker/GetFinished", "/kvd.v1.Peer/Handshake", "/kvd.v1.Peer/Abort", "/kvd.v1.Peer/RenewLeases",
    "/kvd.v1.Peer/ReportFinished", "/kvd.v1.Admin/Status",
]


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    from tests.conftest import Daemons

    ds = Daemons(tmp_path_factory.mktemp("fuzz"))
    p, d = ds.start("prefill"), ds.start("decode")
    # Something to handshake with, alive for the module: a worker that drops its memory
    # without unregistering is taken for gone (each test's end unlinks this process's regions).
    alive = make_worker(p.grpc, "prefill", tp_rank=1, tp_size=2, heads=4)
    yield ds, p, d
    del alive
    for x in ds.started:
        x.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(method=st.sampled_from(METHODS), body=st.binary(max_size=512))
def test_fuzzed_grpc_messages_never_break_the_daemon(fuzz_target, method, body):
    _, p, _ = fuzz_target
    with grpc.insecure_channel(p.grpc) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(body, timeout=5)
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.INTERNAL or "Exception" not in (e.details() or ""), e.details()
            assert e.code() != grpc.StatusCode.UNKNOWN, e.details()


def _header(type_: int, tag: int, length: int, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, type_, 0, tag, length)


frames = st.one_of(
    st.builds(_header, st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),  # any header
    st.builds(_header, st.just(int(FrameType.READ)), st.integers(0, 10), st.integers(1 << 21, 2**64 - 1)),  # oversized
    st.binary(max_size=40),  # truncated / garbage
    st.builds(lambda body: _header(int(FrameType.READ), 0, len(body)) + body, st.binary(max_size=200)),  # garbage READ bodies
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.lists(frames, min_size=1, max_size=4))
def test_fuzzed_data_plane_frames_never_leak_or_crash(fuzz_target, data):
    _, p, _ = fuzz_target
    token = handshake(p.grpc, fake_engine("fuzzer", heads=4)).data_token
    raw = RawPeer(p.info["data"], timeout=5)
    try:
        if raw.hello("fuzzer", "e1", token)[0] is not FrameType.HELLO_OK:
            return
        for chunk in data:
            raw.send_raw(chunk)
        raw.sock.shutdown(socket.SHUT_WR)
        while True:  # whatever comes back is control frames, never DATA
            ftype, _, _ = raw.recv_frame()
            assert ftype is not FrameType.DATA
    except (ConnectionError, OSError, struct.error):
        pass
    except Exception as e:  # a ProtocolError decoding the daemon's reply would be a bug
        raise AssertionError(f"unexpected reply: {e}") from e
    finally:
        raw.close()


def test_after_fuzzing_the_daemon_still_serves_a_correct_transfer(fuzz_target):
    _, p, d = fuzz_target
    pw = make_worker(p.grpc, "prefill", tp_rank=0, tp_size=2, heads=4)
    dw = make_worker(d.grpc, "decode", heads=4)
    pw2 = make_worker(p.grpc, "prefill", tp_rank=1, tp_size=2, heads=4)
    for w in (pw, pw2):
        w.fill(5, [1, 2])
    cap = secrets.token_bytes(32)
    published = [w.client.publish("after-fuzz", [[1, 2]], 32, capability=cap) for w in (pw, pw2)]  # both ranks
    params = published[0]
    dw.client.pull("after-fuzz", params, [[3, 4]])
    f = dw.client.wait_finished(recving={"after-fuzz"}, timeout=30)
    assert f.details[("recving", "after-fuzz")].outcome == "done"
    assert dw.mismatch(5, [3, 4], 32) is None


def test_mtls_data_plane_is_tls_and_refuses_plaintext_or_foreign_certificates(daemons, pki):
    import ssl

    files, ca = pki
    cert, key = files["good"]
    flags = ("--auth", "mtls", "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-file", ca)
    p = daemons.start("prefill", *flags)
    auth = AuthConfig.load("mtls", cert_file=cert, key_file=key, ca_file=ca)
    pw = make_worker(p.grpc, "prefill", auth=auth)
    pw.fill(1, [1, 2])
    pw.client.publish("r", [[1, 2]], 32)
    host, port = p.info["data"].rsplit(":", 1)
    # Plaintext: the TLS handshake fails, the connection closes, and not one frame comes back.
    raw = RawPeer(p.info["data"])
    raw.send(FrameType.HELLO, pb.DataHello(engine_id="x", epoch="e").SerializeToString())
    with pytest.raises((ConnectionError, OSError, ValueError)):
        raw.recv_frame()
    raw.close()
    # A certificate from another CA: refused in the handshake.
    rogue_cert, rogue_key = files["rogue"]
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    ctx.load_cert_chain(rogue_cert, rogue_key)
    with socket.create_connection((host, int(port)), timeout=5) as s, pytest.raises((ssl.SSLError, ConnectionError, OSError)), \
            ctx.wrap_socket(s) as tls:
        tls.sendall(b"x")
        tls.recv(1)  # TLS 1.3 reports the server's refusal on first read


def test_status_reaches_a_token_daemon_only_with_the_token(token_daemons, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    p, _d, _pw, _dw, token = token_daemons
    path = write_secret(tmp_path / "status-token", token)
    base = [sys.executable, "-m", "kvd", "status", p.grpc]
    denied = subprocess.run(base, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    ok = subprocess.run([*base, "--auth", "token", "--token-file", path], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert ok.returncode == 0 and "engine prefill" in ok.stdout

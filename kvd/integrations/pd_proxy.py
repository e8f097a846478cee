"""A small P/D proxy for OpenAI-compatible servers (vLLM's toy proxy, in the standard library).

For each completion request it asks a prefill server for one token with
``kv_transfer_params={"do_remote_decode": True}``, then sends the original
request to a decode server with the ``kv_transfer_params`` the prefill
returned, and relays the decode's answer (streamed if the client asked).

    kvd proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Several ``--prefill``/``--decode`` servers are used round-robin.

With ``--prefill-kvd`` (each prefill server's kvd daemon, in the same order)
requests stream layer by layer: the proxy names the publication and picks
its capability, and sends the request to prefill and decode at once. P
publishes before it computes and saves each layer as it goes; D's daemon
reads each layer as it is saved, so the transfer overlaps the prefill.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import secrets
import threading
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from kvd.integrations.kv_params import stream_params, with_qos

log = logging.getLogger("kvd.proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Upstream:
    """One OpenAI-compatible server."""

    def __init__(self, url: str, timeout: float) -> None:
        u = urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream url {url!r} must be http://host:port")
        self.url, self.host, self.port, self.timeout = url, u.hostname, u.port or 80, timeout

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", path, json.dumps(body).encode(), {**headers, "Content-Type": "application/json"})
        return conn.getresponse()

    def get(self, path: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("GET", path)
        return conn.getresponse()


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill half: one token, no streaming, asking P to keep the KV for D."""
    req = dict(body)
    req["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        req.pop(key, None)
    return req


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode half: the client's request with P's params, and the
    client's place on a contended wire (``QOS_KEYS``) passed through."""
    req = dict(body)
    params = prefill_response.get("kv_transfer_params")
    if params:
        req["kv_transfer_params"] = with_qos(params, body.get("kv_transfer_params"))
    return req


class Proxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, timeout: float = 600.0, prefill_kvd: Sequence[str] = ()) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode server")
        if prefill_kvd and len(prefill_kvd) != len(prefill):
            raise ValueError(f"--prefill-kvd gives {len(prefill_kvd)} daemons for {len(prefill)} --prefill servers: one each, in order")
        self.prefill = [Upstream(u, timeout) for u in prefill]
        # Layer-wise streaming: each prefill server's daemon, and its engine id (asked once).
        self.kvd = dict(zip(self.prefill, prefill_kvd, strict=False))
        self._engine_ids: dict[str, str] = {}
        self.decode = [Upstream(u, timeout) for u in decode]
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self._lock = threading.Lock()

    def pick(self) -> tuple[Upstream, Upstream]:
        with self._lock:
            return next(self._p), next(self._d)

    def stream_params(self, p: Upstream) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """P's and D's params for one streamed request (None: not streaming)."""
        address = self.kvd.get(p)
        if address is None:
            return None
        if address not in self._engine_ids:
            from kvd.client import daemon_status

            self._engine_ids[address] = daemon_status(address).engine_id
        return stream_params(name=f"kvd-{uuid.uuid4().hex}", capability=secrets.token_bytes(32), engine_id=self._engine_ids[address],
                             address=address)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.info("%s %s", self.address_string(), fmt % args)

            def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status: int, message: str) -> None:
                self._reply(status, json.dumps({"error": {"message": message, "code": status}}).encode())

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, b'{"status": "ok"}')
                    return
                try:
                    resp = proxy.decode[0].get(self.path)
                    self._reply(resp.status, resp.read(), resp.getheader("Content-Type", "application/json"))
                except OSError as e:
                    self._error(502, f"decode server {proxy.decode[0].url}: {e}")

            def do_POST(self) -> None:
                if self.path not in COMPLETION_PATHS:
                    self._error(404, f"no route for POST {self.path}; use one of {list(COMPLETION_PATHS)}")
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except ValueError as e:
                    self._error(400, f"request body: {e}")
                    return
                p, d = proxy.pick()
                headers = {"X-Request-Id": self.headers.get("X-Request-Id") or str(uuid.uuid4())}
                if self.headers.get("Authorization"):
                    headers["Authorization"] = self.headers["Authorization"]
                try:
                    streamed = proxy.stream_params(p)
                except Exception as e:
                    self._error(502, f"prefill daemon {proxy.kvd.get(p)}: {e}")
                    return
                if streamed is not None:
                    # Both at once: D's pull reads each layer as P saves it.
                    threading.Thread(target=_prefill_only, args=(p, self.path, {**prefill_request(body), "kv_transfer_params": streamed[0]}, headers),
                                     daemon=True).start()
                    dbody = {**body, "kv_transfer_params": with_qos(streamed[1], body.get("kv_transfer_params"))}
                else:
                    try:
                        presp = p.post(self.path, prefill_request(body), headers)
                        pbody = presp.read()
                    except OSError as e:
                        self._error(502, f"prefill server {p.url}: {e}")
                        return
                    if presp.status != 200:
                        self._reply(presp.status, pbody, presp.getheader("Content-Type", "application/json"))
                        return
                    dbody = decode_request(body, json.loads(pbody))
                try:
                    dresp = d.post(self.path, dbody, headers)
                except OSError as e:
                    self._error(502, f"decode server {d.url}: {e}")
                    return
                if not body.get("stream"):
                    self._reply(dresp.status, dresp.read(), dresp.getheader("Content-Type", "application/json"))
                    return
                self.send_response(dresp.status)
                self.send_header("Content-Type", dresp.getheader("Content-Type", "text/event-stream"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in _chunks(dresp):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        return Handler


def _prefill_only(p: Upstream, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A streamed request's prefill half: its answer is not relayed (decode's
    load fails, and decode computes the prompt itself, if it never publishes)."""
    try:
        resp = p.post(path, body, headers)
        text = resp.read()
        if resp.status != 200:
            log.warning("prefill server %s answered %s for a streamed request: %s", p.url, resp.status, text[:300])
    except OSError as e:
        log.warning("prefill server %s: %s (decode computes the prompt itself)", p.url, e)


def _chunks(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            return
        yield chunk


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="prefill server base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode server base URL (repeatable)")
    p.add_argument("--prefill-kvd", action="append", default=[],
                   help="each --prefill server's kvd daemon (host:port, in order): stream layer by layer, sending to prefill and decode at once")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="the port to listen on (0: any free one)")


def _port(text: str) -> int:
    """A TCP port, checked as it is parsed: bind's own error was a traceback."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def serve(args: argparse.Namespace) -> int:
    proxy = Proxy(args.prefill, args.decode, prefill_kvd=args.prefill_kvd)
    server = ThreadingHTTPServer((args.host, args.port), proxy.handler())
    server.daemon_threads = True
    mode = f"; streaming layer by layer from daemons {', '.join(args.prefill_kvd)}" if args.prefill_kvd else ""
    print(f"kvd proxy on http://{args.host}:{server.server_address[1]}: prefill {', '.join(args.prefill)} -> decode {', '.join(args.decode)}{mode}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

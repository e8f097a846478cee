"""A P/D proxy that knows vLLM's disaggregation convention and nothing of kvd.

Like vLLM's example proxy for its NIXL connector: the prefill request goes
out with ``kv_transfer_params`` asking for a remote decode (the ``remote_*``
keys null) and ``max_tokens`` 1; the ``kv_transfer_params`` of its answer go
into the decode request as they are; the decode answer, streamed or not, is
passed back. Run under the vLLM environment's Python (FastAPI, httpx).

``GET /timings`` returns where each request's time to first token went, in
ms: ``prefill`` (the prefill request, answered), and ``decode_first`` (from
sending the decode request to its first byte: the KV transfer, decode's
scheduling of a request waiting for remote KV, and its first step).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None)
    timings: list[dict[str, float]] = []

    @app.get("/timings")
    async def get_timings() -> list[dict[str, float]]:
        return timings

    def record(t0: float, t1: float) -> None:
        timings.append({"prefill": (t1 - t0) * 1e3, "decode_first": (time.perf_counter() - t1) * 1e3})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS)}
        pre.pop("stream_options", None)
        t0 = time.perf_counter()
        answer = await client.post(f"{prefill}/v1/completions", json=pre)
        t1 = time.perf_counter()
        if answer.status_code != 200:
            return JSONResponse(answer.json(), status_code=answer.status_code)
        dec = {**body, "kv_transfer_params": answer.json().get("kv_transfer_params")}
        if not body.get("stream"):
            out = await client.post(f"{decode}/v1/completions", json=dec)
            record(t0, t1)
            return JSONResponse(out.json(), status_code=out.status_code)

        async def relay() -> Any:
            first = True
            async with client.stream("POST", f"{decode}/v1/completions", json=dec) as out:
                async for chunk in out.aiter_raw():
                    if first:
                        first = False
                        record(t0, t1)
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(build(args.prefill, args.decode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""A request's place on a contended wire, through the vLLM connector: the
client's ``kv_transfer_params`` name its class, tenant and deadline, ``kvd
proxy`` passes them to decode, the connector to its daemon's pull, and the
owner's sends are counted under them. A tenant no daemon knows is refused
by name, and the request fails as vLLM's default failure policy says."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.conftest import scrape
from tests.vllm_support import (
    BYTES_PER_BLOCK_PER_LAYER,
    LAYERS,
    PROMPTS,
    OpenAIPD,
    blocks,
    complete_pd,
    openai_pd_servers,
    received_bytes,
)

# The first vLLM test a run reaches builds the environment and the model (minutes, in its setup, which the timeout counts).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def qos_pd(vllm_python, model_dir, tmp_path_factory) -> Iterator[OpenAIPD]:
    with openai_pd_servers(vllm_python, model_dir, tmp_path_factory.mktemp("qos-pd"), "--tenants", "gold=3,silver=1") as pd:
        yield pd


def test_the_clients_class_and_tenant_reach_the_wire_and_an_unknown_tenant_is_refused(qos_pd, model_dir, baseline, tmp_path):
    url = qos_pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
    qos = {"kvd_priority": "interactive", "kvd_tenant": "gold", "kvd_deadline_ms": 2000}
    assert complete_pd(qos_pd, url, model_dir, PROMPTS[0], kv_transfer_params=qos) == baseline[0]
    moved = blocks(len(PROMPTS[0]) - 1) * LAYERS * BYTES_PER_BLOCK_PER_LAYER
    assert scrape(qos_pd.p_metrics, "kvd_qos_bytes_total", priority="interactive", tenant="gold") == moved
    assert received_bytes(qos_pd.d_metrics) == moved
    # The negative control: a tenant neither daemon knows. D's daemon refuses the pull by
    # name and nothing moves; vLLM's default failure policy (fail) fails the request.
    with pytest.raises(AssertionError, match="answered 500"):
        complete_pd(qos_pd, url, model_dir, PROMPTS[1], kv_transfer_params={"kvd_tenant": "mallory"})
    assert received_bytes(qos_pd.d_metrics) == moved
    decode_log = qos_pd.decode.log.read_text(errors="replace")
    assert "refused by the local daemon (INVALID_ARGUMENT): tenant='mallory' is not a configured tenant" in decode_log, decode_log[-3000:]
    # The pair serves on: the next request, in the default class and tenant, as one engine.
    assert complete_pd(qos_pd, url, model_dir, PROMPTS[2]) == baseline[2]

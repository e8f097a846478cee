"""The public API, pinned: what ``kvd``, ``kvd.client``, ``kvd.errors``,
``kvd.spec`` and ``kvd.caches`` export, the exception classes and what each
one's ``code`` compares equal to, and the signatures of ``KvdClient``'s
methods. A change to any of these must be a deliberate edit of this file
(and a CHANGELOG line): users' code depends on them."""

from __future__ import annotations

import importlib
import inspect

import grpc
import pytest

import kvd.errors
from kvd.client import KvdClient
from tests.conftest import make_worker

EXPORTS = {
    "kvd": ["__version__"],
    "kvd.client": [
        "AfterDevice", "DeadlineExceeded", "Finished", "FinishedFeed", "FinishedStream", "GroupKind", "KVCacheSpec", "KvdClient",
        "KvdError", "ModelInfo", "Unavailable", "VLLM_NHD_DIMS", "WORKER_TOKEN_HEADER", "WorkerId", "daemon_status", "from_code",
        "infer_spec", "infer_spec_from_tensors",
    ],
    "kvd.errors": [
        "Aborted", "DeadlineExceeded", "FailedPrecondition", "Incompatible", "InvalidArgument", "KvdError", "NotFound",
        "PermissionDenied", "ResourceExhausted", "Status", "Unauthenticated", "Unavailable", "from_code",
    ],
    "kvd.spec": [
        "CANONICAL", "CHUNKED_LOCAL", "CPU_ATTENTION_PARTS", "DTYPE_SIZES", "EngineLayout", "EngineMeta", "FULL", "FULL_ATTENTION",
        "GroupKind", "GroupSpec", "KNOWN_DIMS", "KVCacheSpec", "LayerSpec", "ModelInfo", "NAMED_LAYOUTS", "SLIDING_WINDOW", "STATE",
        "STATE_PART", "TensorRef", "WorkerId", "compat_fields", "fingerprint", "infer_spec", "layout_name", "parse_layout",
        "physical_order",
    ],
    "kvd.caches": [
        "Described", "KVCacheTensors", "ShmRegion", "adopt_into_shm", "alive_token", "allocate_cpu_attention_caches", "allocate_kv_caches",
        "allocate_state_pages", "cpu_attention_parts", "describe", "layer_index_of", "local_group_tensors", "release_all", "torch_dtype",
    ],
}

# Each exception class and the gRPC status its ``code`` is (``status``: the same, as kvd's own Status).
CODES = {
    "KvdError": "INTERNAL", "InvalidArgument": "INVALID_ARGUMENT", "Incompatible": "FAILED_PRECONDITION",
    "FailedPrecondition": "FAILED_PRECONDITION", "NotFound": "NOT_FOUND", "PermissionDenied": "PERMISSION_DENIED",
    "Unauthenticated": "UNAUTHENTICATED", "ResourceExhausted": "RESOURCE_EXHAUSTED", "Unavailable": "UNAVAILABLE",
    "Aborted": "ABORTED", "DeadlineExceeded": "DEADLINE_EXCEEDED",
}

KVD_CLIENT = {
    "__init__": "(self, address: 'str', worker: 'WorkerId', *, timeout: 'float' = 30.0, auth: 'AuthConfig | None' = None) -> 'None'",
    "abort": "(self, request_id: 'str', *, release: 'pb.TransferParams | None' = None) -> 'bool'",
    "close": "(self) -> 'None'",
    "engine_finished": "(self) -> 'Finished'",
    "flush_saves": "(self) -> 'None'",
    "get_finished": "(self) -> 'Finished'",
    "layers_saved": "(self, request_ids: 'Sequence[str]', layers_saved: 'int', *, wait: 'bool' = False) -> 'None'",
    "publish": "(self, request_id: 'str', block_ids: 'Sequence[Sequence[int]]', num_tokens: 'int', *, capability: 'bytes' = b'', "
               "reader_engine_id: 'str' = '', lease_seconds: 'float' = 0.0, first_tokens: 'Sequence[int]' = (), stream: 'bool' = False, "
               "verify: 'str' = '', computed_at_ns: 'int' = 0) -> 'pb.TransferParams'",
    "publish_engine": "(self, request_id: 'str', block_ids: 'Sequence[Sequence[int]]', num_tokens: 'int', *, capability: 'bytes' = b'', "
                      "reader_engine_id: 'str' = '', lease_seconds: 'float' = 0.0, first_tokens: 'Sequence[int]' = (), verify: 'str' = '', "
                      "computed_at_ns: 'int' = 0) -> 'pb.TransferParams'",
    "pull": "(self, request_id: 'str', params: 'pb.TransferParams', local_block_ids: 'Sequence[Sequence[int]]', *, "
            "first_tokens: 'Sequence[int]' = (), priority: 'str' = '', tenant: 'str' = '', deadline_ms: 'float' = 0.0) -> 'None'",
    "pull_nowait": "(self, request_id: 'str', params: 'pb.TransferParams', local_block_ids: 'Sequence[Sequence[int]]', *, "
                   "first_tokens: 'Sequence[int]' = (), answered: 'Callable[[KvdError | None], None]', priority: 'str' = '', tenant: 'str' = '', "
                   "deadline_ms: 'float' = 0.0) -> 'None'",
    "register": "(self, kv_caches: 'Mapping[str, KVCacheTensors] | Sequence[tuple[KVCacheSpec, Mapping[str, KVCacheTensors]]]', "
                "model: 'ModelInfo', spec: 'KVCacheSpec | None' = None, *, dims: 'Sequence[str] | Sequence[Sequence[str]] | None' = None, "
                "block_size: 'int' = 0, use_mla: 'bool' = False, kinds: 'Sequence[GroupKind]' = ()) -> 'pb.RegisterResponse'",
    "set_expected_finished_count": "(self, count: 'int') -> 'int'",
    "unregister": "(self) -> 'None'",
    "wait_finished": "(self, recving: 'set[str]' = frozenset(), sending: 'set[str]' = frozenset(), timeout: 'float' = 60.0, "
                     "poll: 'float' = 0.001) -> 'Finished'",
    "wait_ready": "(self, timeout: 'float' = 30.0) -> 'None'",
    "watch_engine_finished": "(self) -> 'Iterator[Finished]'",
    "watch_finished": "(self, resume_after: 'int | None' = None) -> 'FinishedStream'",
}


@pytest.mark.parametrize("module", list(EXPORTS))
def test_each_public_module_exports_exactly_its_names(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(EXPORTS[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is listed but missing"


def test_each_exception_class_and_what_its_code_equals():
    classes = {n: getattr(kvd.errors, n) for n in kvd.errors.__all__ if isinstance(getattr(kvd.errors, n), type) and issubclass(getattr(kvd.errors, n), Exception)}
    assert sorted(classes) == sorted(CODES)
    for name, cls in classes.items():
        err = kvd.errors.from_code(CODES[name], "m") if name not in ("KvdError", "Incompatible") else cls.__new__(cls)
        assert isinstance(err, kvd.errors.KvdError)
        assert cls.status == kvd.errors.Status[CODES[name]], name
        # What users have compared it with since the first release: the grpc code.
        assert err.code == getattr(grpc.StatusCode, CODES[name]), name
        assert err.code is getattr(grpc.StatusCode, CODES[name]), name
        assert err.code != grpc.StatusCode.OK


def test_a_refusal_from_a_real_daemon_compares_equal_to_its_grpc_code(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill")
    with pytest.raises(kvd.errors.KvdError) as e:
        pw.client.publish("r", [[1, 1]], 16)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT  # a user's check, as before the restructuring
    assert e.value.code != grpc.StatusCode.NOT_FOUND  # and it can fail
    assert e.value.status == kvd.errors.Status.INVALID_ARGUMENT


def test_daemon_status_waits_for_a_daemon_that_is_not_up_then_names_it(daemons):
    import socket

    from kvd.client import daemon_status

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(kvd.errors.DeadlineExceeded, match=f"{address} not reachable \\(or not answering\\) after 0.5s"):
        daemon_status(address, timeout=0.5)
    with pytest.raises(kvd.errors.Unavailable):  # without waiting: refused at once
        daemon_status(address, timeout=5, wait_ready=False)
    p = daemons.start("prefill")
    assert daemon_status(p.grpc).engine_id == "prefill"


def test_kvd_client_methods_keep_their_signatures():
    got = {n: str(inspect.signature(f)) for n, f in inspect.getmembers(KvdClient, inspect.isfunction)
           if not n.startswith("_") or n == "__init__"}
    assert got == KVD_CLIENT

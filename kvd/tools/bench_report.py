"""``kvd bench``'s verdict: each figure's worst value over the rounds of one
run, beside its limit.

A ratio holds only when both sides are measured in the same round, and a
target holds only if it holds in every round: this machine's speed moves by
up to 3x between hours, so the best round says little. The limits are the
performance issue's targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    key: str
    what: str
    higher_is_better: bool
    limit: float | None  # None: reported, no target set

    def worst(self, values: Sequence[float]) -> float:
        return min(values) if self.higher_is_better else max(values)

    def met(self, value: float) -> bool | None:
        if self.limit is None:
            return None
        return value >= self.limit if self.higher_is_better else value <= self.limit

    @property
    def limit_text(self) -> str:
        if self.limit is None:
            return "-"
        return f"{'>=' if self.higher_is_better else '<='} {self.limit:g}"


TARGETS = (
    Target("relayout_vs_memcpy_min", "relayout / best memcpy (1..cores threads), worst pairing, state included", True, 0.7),
    Target("samehost_vs_memcpy", "same-host 1 MiB units / best memcpy (1..cores threads)", True, 0.85),
    Target("tcp_16k_vs_1m", "TCP 16 KiB units / 1 MiB units", True, 0.95),
    Target("socket_scattered_16k_vs_1m", "the same, plain sendmsg/recvmsg of the same pieces", True, None),
    Target("tcp_16k_vs_kernel", "the same over the kernel's own ratio, median of 5 paired tries (the 16 KiB target holds where this row or the first does)", True, 0.95),
    Target("tcp_vs_socket_1m", "TCP 1 MiB units / best plain socket (1..stripes connections)", True, 1.0),
    Target("tcp_cpu_vs_socket", "CPU s per GB, both daemons / both socket ends", False, 1.2),
    Target("small_request_p50_vs_floor", "small request p50 / its physical floor", False, 2.0),
    Target("small_request_p99_vs_floor", "small request p99 / its floor", False, None),
    Target("skeleton_p50_vs_floor", "the same through kvd's process chain with no kvd logic, p50 / floor", False, None),
    Target("skeleton_p99_vs_floor", "the same, p99 / floor", False, None),
    Target("small_request_p50_vs_skeleton", "small request p50 / its process chain alone (kvd's own cost)", False, 1.25),
    Target("small_request_p99_vs_skeleton", "small request p99 / its process chain alone", False, 1.5),
    Target("vs_nixl", "kvd / NIXL, worst unit size", True, 1.5),
    Target("vs_mooncake", "kvd TCP / Mooncake TE tcp, worst unit size", True, 1.5),
    Target("control_growth", "control plane per block, 100k blocks / 1k blocks", False, 1.5),
    Target("control_vs_transfer_128k", "control plane / transfer time, 128k tokens of 16-token blocks", False, 0.05),
    Target("control_vs_transfer_128k_staged", "the same in a staged read's segments (relayout, TLS, hetero reads)", False, 0.05),
    Target("stream_vs_pull_long", "TTFT added by the transfer past a busy prefill, streamed / pulled, longest prompt", False, 0.10),
    Target("stream_vs_pull_short", "TTFT added by the transfer past a busy prefill, streamed / pulled, shortest prompt", False, 1.0),
    Target("verify_sampled_cost_tcp", "sampled verification: time added (digest + check) / transfer time, TCP 1 MiB", False, 0.02),
    Target("verify_sampled_cost_samehost", "the same, same-host 1 MiB", False, 0.02),
    Target("verify_sampled_vs_off_tcp", "sampled / off throughput, alternated tries, TCP (noise is +-5%)", True, None),
    Target("verify_sampled_vs_off_samehost", "the same, same-host", True, None),
    Target("verify_full_cpu_vs_off_tcp", "full verification: CPU s per GB / off's, TCP 1 MiB", False, 1.3),
    Target("verify_full_cpu_vs_off_samehost", "the same, same-host 1 MiB", False, 1.3),
    Target("verify_full_floor_tcp", "the least full can cost here: off + a read pass of every byte on each side, TCP", False, None),
    Target("verify_full_floor_samehost", "the same, same-host", False, None),
    Target("verify_full_hash_floor_tcp", "the least full can cost with numpy's hash: off + one uint64 dot pass of every byte on each side, TCP",
           False, None),
    Target("verify_full_hash_floor_samehost", "the same, same-host", False, None),
    Target("qos_small_p99_loaded_vs_unloaded", "small interactive pulls' p99 beside two bulk pulls / idle (--qos on)", False, 2.0),
    Target("qos_tenant_share_error", "tenants with shares 3:1, |bytes ratio / 3 - 1| over a contended window", False, 0.10),
    Target("qos_best_effort_finished", "a best-effort tenant's pulls finished under the load (1: every one)", True, 1.0),
    Target("load_rss_growth", "daemon RssAnon growth over the load, after warm-up (worst daemon)", False, 0.10),
    Target("gpu_tcp_vs_socket_16k", "GPU to GPU over TCP, 16 KiB units / slower of socket and PCIe", True, 1.0),
    Target("gpu_tcp_vs_socket_1m", "GPU to GPU over TCP, 1 MiB units / slower of socket and PCIe", True, None),
    Target("gpu_samehost_vs_d2d_1m", "GPU same-host, pull to landed / device memcpy", True, 0.5),
    Target("gpu_pieces_vs_d2d", "GPU same-host piece kernel alone / device memcpy", True, None),
)


def add_derived(out: dict[str, Any]) -> None:
    """Ratios computed from one round's figures (in place)."""
    floor = out.get("small_request_floor_ms")
    if floor:
        out["small_request_p50_vs_floor"] = out["small_request_p50_ms"] / floor
        out["small_request_p99_vs_floor"] = out["small_request_p99_ms"] / floor
        out["skeleton_p50_vs_floor"] = out["skeleton_p50_ms"] / floor
        out["skeleton_p99_vs_floor"] = out["skeleton_p99_ms"] / floor
        out["small_request_p50_vs_skeleton"] = out["small_request_p50_ms"] / out["skeleton_p50_ms"]
        out["small_request_p99_vs_skeleton"] = out["small_request_p99_ms"] / out["skeleton_p99_ms"]


def verdict(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per target measured: its worst value, each round's that
    measured it (``load`` runs in the last round only), the limit, met."""
    rows = []
    for t in TARGETS:
        values = [r[t.key] for r in rounds if r.get(t.key) is not None]
        if not values:
            continue
        worst = t.worst([float(v) for v in values])  # type: ignore[arg-type]
        rows.append({"figure": t.key, "what": t.what, "worst": worst, "rounds": [float(v) for v in values],  # type: ignore[arg-type]
                     "limit": t.limit_text, "met": t.met(worst)})
    return rows


def worst_of(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures: the last round's, with every target's key replaced by its worst round."""
    out = dict(rounds[-1])
    for row in verdict(rounds):
        out[row["figure"]] = row["worst"]
    return out


def print_verdict(rows: Sequence[dict[str, Any]], rounds: int, say: Callable[[str], None]) -> None:
    say("")
    say(f"verdict: each figure's worst of {rounds} round{'s' if rounds > 1 else ''}, beside its limit")
    say(f"  {'figure':<28} {'worst':>6}  {'limit':<8} {'':<6}  {'each round':<24} what")
    for row in rows:
        mark = {True: "ok", False: "MISSED", None: ""}[row["met"]]
        each = " ".join(f"{v:.2f}" for v in row["rounds"])
        say(f"  {row['figure']:<28} {row['worst']:6.2f}  {row['limit']:<8} {mark:<6}  {each:<24} {row['what']}")

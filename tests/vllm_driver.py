"""Runs real vLLM engines for tests/test_vllm.py (under the vLLM environment's Python).

Modes:

* ``make-model``: a tiny Llama (config and seeded random weights). vLLM's
  dummy weights are so small that attention barely moves the logits, so the
  tokens would not show whether the KV cache was right; these do.
* ``baseline``: one ordinary engine, no connector: the tokens to match.
* ``pd``: a prefill engine and a decode engine in this process, each wired to
  its own kvd daemon through ``kvd.integrations.vllm``. Every prompt is
  prefilled on P (one token), then decoded on D with P's kv_transfer_params.
  Along the way it records what the daemons say, for the test to assert on.
* ``hetero``: the same across TP sizes and block sizes, plus a load that
  fails (P must release at once) and the negative control.

Writes one JSON object to ``--out``. vLLM spawns workers, hence the guard.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def engine(model: str, kvd_address: str | None, role: str | None, *, tp: int = 1, pp: int = 1, block_size: int | None = None, dtype: str = "auto",
           failure_policy: str = "fail", llm_kw: dict[str, Any] | None = None, **extra: Any) -> Any:
    """``llm_kw``: more of ``LLM``'s own arguments; ``extra``: the connector's extra config."""
    import os

    from vllm import LLM

    kw: dict[str, Any] = {}
    if kvd_address:
        kw["kv_transfer_config"] = {
            "kv_connector": "KvdConnector",
            "kv_connector_module_path": "kvd.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": {"kvd_address": kvd_address, **extra},
        }
    if tp > 1 or pp > 1:
        kw |= {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "distributed_executor_backend": "mp"}
    if block_size:
        kw["block_size"] = block_size
    # One OpenMP thread bound per rank, or some models diverge; each engine's
    # processes are spawned now and take the binding with them. Every rank of
    # every engine goes on core 0, leaving core 1 to the daemons and the kernel:
    # an idle vLLM worker spins on sched_yield (its message queue's busy loop,
    # renewed by every engine step while P holds a request), and with spinners
    # pinned to both cores this kernel starved its own RCU and workqueue threads
    # for up to a minute (dmesg: "workqueue lockup", "rcu_preempt kthread
    # starved"), stalling every socket on the machine, kvd's included.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join("0" for _ in range(tp * pp))
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype=dtype,
               **{"kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024, "max_num_seqs": 8, **kw, **(llm_kw or {})})


def sampling(max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, extra_args=extra)


def generate(llm: Any, prompt: list[int], sp: Any) -> Any:
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def status(address: str) -> Any:
    from kvd.client import daemon_status

    return daemon_status(address)


def leases(address: str) -> set[str]:
    return {x.request_id for x in status(address).leases}


def wait_until(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def received_bytes(metrics_url: str) -> float:
    from kvd.testing.metrics import scrape

    return scrape(metrics_url, "kvd_received_bytes_total", timeout=10)


def corrupt_prefill_cache(p_address: str) -> int:
    """Zero every shm region P's workers registered (valid numbers, wrong KV)."""
    import numpy as np

    n = 0
    for w in status(p_address).workers:
        for name in w.region_ids:
            mm = np.memmap(f"/dev/shm/{name}", dtype=np.uint8, mode="r+")
            mm[:] = 0
            mm.flush()
            n += mm.size
    return n


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 1000,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def make_model(d: Path, sliding_window: int = 0) -> None:
    """Config and seeded N(0, sigma) weights, scaled so attention matters.
    With ``sliding_window``, layer 0 attends to a window and layer 1 to
    everything (vLLM's Llama reads ``layer_types``), a Gemma/gpt-oss-style
    hybrid whose two KV cache groups vLLM's hybrid allocator keeps apart."""
    import torch
    from safetensors.torch import save_file

    c = dict(LLAMA)
    if sliding_window:
        c |= {"sliding_window": sliding_window, "layer_types": ["sliding_attention", "full_attention"]}
    hidden, inter, vocab, heads, kv_heads, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).contiguous()

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    sd = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "model.norm.weight": ones.clone(),
          "lm_head.weight": w(vocab, hidden, std=4 / hidden**0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(heads * hd, hidden, std=3 / hidden**0.5),
               p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden, std=3 / hidden**0.5),
               p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden, std=1 / hidden**0.5),
               p + "self_attn.o_proj.weight": w(hidden, heads * hd, std=1 / (heads * hd) ** 0.5),
               p + "mlp.gate_proj.weight": w(inter, hidden, std=1 / hidden**0.5),
               p + "mlp.up_proj.weight": w(inter, hidden, std=1 / hidden**0.5),
               p + "mlp.down_proj.weight": w(hidden, inter, std=1 / inter**0.5),
               p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone()}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(d, vocab)


# Tiny hybrids and a pure Mamba2, as transformers defines them (its random
# init, then scaled): state heads split over TP2 (Mamba2 groups too), and a
# CPU-kernel-friendly gated delta-net (head dims of 128, bf16 only on CPU).
HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2": ("Mamba2ForCausalLM", {"num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16,
                                     "conv_kernel": 4, "expand": 1, "chunk_size": 64}),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", {
        "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 64, "num_local_experts": 0,
        "shared_intermediate_size": 256, "position_embedding_type": "rope", "embedding_multiplier": 1.0, "logits_scaling": 1.0,
        "residual_multiplier": 1.0, "attention_multiplier": 1 / 32**0.5}),
    "qwen3_next": ("Qwen3NextForCausalLM", {
        "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1}),
}


def make_hybrid(d: Path, family: str) -> None:
    """A tiny random model of ``family`` whose output depends on its state.
    At transformers' default init the state barely reaches the logits, so
    the in/out projections are scaled up, and every SSM and gated delta-net
    layer decays by exp(-0.001 dt) a step: a token 250 back still counts."""
    import torch
    import transformers

    arch, fields = HYBRIDS[family]
    torch.manual_seed(0)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    c = config_class(vocab_size=1000, hidden_size=128, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     tie_word_embeddings=False, initializer_range=0.08, **fields)
    c.architectures = [arch]
    model = getattr(transformers, arch)(c).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(float(torch.log(torch.tensor(0.001))))
            elif name.endswith("dt_bias"):
                p.fill_(0.5)
            elif name.endswith(("in_proj.weight", "out_proj.weight")):
                p.mul_(3.0)
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(d), safe_serialization=True)
    make_tokenizer(d, 1000)


def make_tokenizer(d: Path, vocab: int) -> None:
    """One word per token id ("t17"), split on spaces: text and ids convert
    exactly both ways, so ``vllm bench serve`` can make random prompts of
    exact lengths (it decodes random ids and encodes them again)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(str(d))


def run_pd(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    p = engine(args.model, args.p_kvd, "kv_producer")
    d = engine(args.model, args.d_kvd, "kv_consumer")
    out: dict[str, Any] = {"tokens": [], "checks": []}
    *pd_prompts, control = prompts  # the last one is kept fresh for the negative control
    for i, prompt in enumerate(pd_prompts):
        pre = generate(p, prompt, sampling(1, {"do_remote_decode": True}))
        params = pre.kv_transfer_params
        rid = params["remote_request_id"]
        # P published and still holds the blocks: nobody has read them yet.
        published_after = wait_until(lambda rid=rid: rid in leases(args.p_kvd), 10, f"publication of {rid}")
        time.sleep(0.5)
        held = rid in leases(args.p_kvd)
        dec = generate(d, prompt, sampling(args.max_tokens, params))
        released_after = wait_until(lambda rid=rid: rid not in leases(args.p_kvd), 10, f"release of {rid}")
        out["tokens"].append(list(dec.outputs[0].token_ids))
        out["checks"].append({"prompt": i, "params": params, "published_after_s": published_after, "held_before_read": held,
                              "released_after_read_s": released_after, "prefill_token": list(pre.outputs[0].token_ids)})
    # The first prompt again: D now holds its full blocks in its prefix cache,
    # so it reads only the tail of P's blocks (and must still match).
    pre = generate(p, pd_prompts[0], sampling(1, {"do_remote_decode": True}))
    out["prefix_hit_tokens"] = list(generate(d, pd_prompts[0], sampling(args.max_tokens, pre.kv_transfer_params)).outputs[0].token_ids)
    rid = pre.kv_transfer_params["remote_request_id"]
    out["prefix_hit_released_after_s"] = wait_until(lambda: rid not in leases(args.p_kvd), 10, f"release of {rid}")
    # A prefill whose decode never comes: the lease ends it and vLLM frees the blocks.
    pre = generate(p, pd_prompts[0], sampling(1, {"do_remote_decode": True, "kvd_lease_seconds": 2}))
    rid = pre.kv_transfer_params["remote_request_id"]
    wait_until(lambda: rid in leases(args.p_kvd), 10, "publication")
    out["abandoned"] = {"request_id": rid, "released_after_s": wait_until(lambda: rid not in leases(args.p_kvd), 30, "lease expiry")}
    # Afterwards P still serves, reusing the freed blocks.
    out["after_expiry_tokens"] = list(generate(p, pd_prompts[0], sampling(args.max_tokens)).outputs[0].token_ids)
    out["preempted_stream"] = preempted_stream(p, d, args.p_kvd, pd_prompts[1])
    # Negative control, last (it spoils P's cache): a fresh prompt, with P's
    # cache overwritten between its prefill and the decode.
    pre = generate(p, control, sampling(1, {"do_remote_decode": True}))
    wait_until(lambda: pre.kv_transfer_params["remote_request_id"] in leases(args.p_kvd), 10, "publication")
    out["corrupted_bytes"] = corrupt_prefill_cache(args.p_kvd)
    dec = generate(d, control, sampling(args.max_tokens, pre.kv_transfer_params))
    out["corrupted_tokens"] = list(dec.outputs[0].token_ids)
    time.sleep(1.0)  # let P's worker log what the daemon reported
    return out


# The engine core decodes on in its own process while this one asks for the reset, so the request
# can finish first however many tokens it asks for (make test runs: at 64 tokens, and in CI at 512,
# which take 1.5 s or more here with the 70 ms this process takes to ask): vLLM then holds its blocks
# for their readers, as it holds every finished publication's, and refuses the reset. Such a try
# preempted nothing: it is told apart (the request finished with every token and its publication is
# still held), D reads the publication so that P frees the blocks, and a fresh request tries again.
PREEMPTED_TOKENS = 512
PREEMPT_TRIES = 3


def preempted_stream(p: Any, d: Any, p_kvd: str, prompt: list[int]) -> dict[str, Any]:
    """A streamed prefill that runs on after its prompt (P asked for
    PREEMPTED_TOKENS), preempted from outside vLLM's schedule once published,
    as ``pause_generation(clear_cache=True)`` does, and resumed by the next step."""
    finished_first: list[dict[str, Any]] = []
    for _ in range(PREEMPT_TRIES):
        tried = _preempt_stream_once(p, d, p_kvd, prompt)
        if "finished_first" not in tried:
            return tried | {"finished_first": finished_first}
        finished_first.append(tried)
    raise RuntimeError(f"the streamed request finished before the reset in each of {PREEMPT_TRIES} tries: {finished_first}")


def _preempt_stream_once(p: Any, d: Any, p_kvd: str, prompt: list[int]) -> dict[str, Any]:
    import secrets

    from kvd.integrations.kv_params import stream_params

    # vLLM resets its cache only when no block is held for a transfer (else it raises: 'running
    # requests waiting for remote KV transfer ... not supported'). The abandoned prefill's blocks
    # are held until P's worker reports its expiry and the scheduler frees them, which can come
    # after its lease has left P's daemon (a make test run failed here: 3 blocks, that prompt's).
    cache_free_after_s = wait_until(p.reset_prefix_cache, 10, "P's engine freeing the blocks of earlier requests")
    name = f"preempted-{secrets.token_hex(4)}"
    prefill, decode = stream_params(name=name, capability=secrets.token_bytes(32), engine_id="prefill", address=p_kvd)
    engine_ = p.llm_engine
    engine_.add_request(name, {"prompt_token_ids": prompt}, sampling(PREEMPTED_TOKENS, prefill))
    engine_.step()  # the prompt's forward, published before it (the engine core goes on decoding)
    out: dict[str, Any] = {"name": name, "published": name in leases(p_kvd), "cache_free_after_s": cache_free_after_s}
    try:
        p.reset_prefix_cache(reset_running_requests=True)  # frees its blocks; the core's next step resumes it
    except Exception as e:  # the core's RuntimeError, raised again by vLLM's client
        if "Failed to reset KV cache" not in str(e):
            raise
        tokens = _finish(engine_)
        if len(tokens) != PREEMPTED_TOKENS or name not in leases(p_kvd):
            raise  # not a request that finished first: something else held blocks
        read = generate(d, prompt, sampling(1, decode)).outputs[0].token_ids
        released = wait_until(lambda: name not in leases(p_kvd), 10, f"release of {name} read by D")
        return out | {"finished_first": str(e)[:120], "read_by_d": list(read), "released_after_s": released}
    out["ended_after_s"] = wait_until(lambda: name not in leases(p_kvd), 10, f"end of {name}")
    return out | {"tokens": _finish(engine_)}


def _finish(engine_: Any) -> list[int]:
    """Step the engine until its requests finish: the last one's tokens."""
    tokens: list[int] = []
    while engine_.has_unfinished_requests():
        tokens = next((list(o.outputs[0].token_ids) for o in engine_.step() if o.finished), tokens)
    return tokens


def run_hetero(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """P and D engines of other TP sizes and block sizes (float32: a TP2
    engine's bf16 partial sums round apart from a TP1 engine's)."""
    p = engine(args.model, args.p_kvd, "kv_producer", tp=args.p_tp, pp=args.p_pp, block_size=args.p_block_size, dtype=args.dtype, llm_kw=args.llm_kw)
    # D recomputes a load that failed: its tokens must then still match.
    d = engine(args.model, args.d_kvd, "kv_consumer", tp=args.d_tp, pp=args.d_pp, block_size=args.d_block_size, dtype=args.dtype,
               failure_policy="recompute", llm_kw=args.llm_kw)
    out: dict[str, Any] = {"tokens": [], "params": [], "received_bytes": []}
    if args.baseline_prompts:
        # D alone first, nothing loaded: one engine's tokens, without starting another engine.
        alone = json.loads(Path(args.baseline_prompts).read_text())
        out["baseline_tokens"] = [list(generate(d, pr, sampling(args.max_tokens)).outputs[0].token_ids) for pr in alone]
        d.reset_prefix_cache()  # or D would hold these prompts itself and load only their tails
    *pd_prompts, control = prompts
    for prompt in pd_prompts:
        pre = generate(p, prompt, sampling(1, {"do_remote_decode": True}))
        rid = pre.kv_transfer_params["remote_request_id"]
        out["params"].append(pre.kv_transfer_params)
        out["tokens"].append(list(generate(d, prompt, sampling(args.max_tokens, pre.kv_transfer_params)).outputs[0].token_ids))
        wait_until(lambda rid=rid: rid not in leases(args.p_kvd), 10, f"release of {rid}")
        if args.d_metrics:  # D's bytes received so far, request by request
            out["received_bytes"].append(received_bytes(args.d_metrics))
    # A load that fails: D asks for a block P never published, P refuses the
    # read, and D must tell P at once instead of leaving it to the lease (120 s).
    pre = generate(p, pd_prompts[0], sampling(1, {"do_remote_decode": True}))
    params = dict(pre.kv_transfer_params)
    rid = params["remote_request_id"]
    wait_until(lambda: rid in leases(args.p_kvd), 10, f"publication of {rid}")
    ids = list(params["remote_block_ids"][0])
    params["remote_block_ids"] = [[*ids[:-1], max(ids) + 1], *params["remote_block_ids"][1:]]
    held = rid in leases(args.p_kvd)
    dec = generate(d, pd_prompts[0], sampling(args.max_tokens, params))
    out["failed_load"] = {"request_id": rid, "held_before": held, "tokens": list(dec.outputs[0].token_ids),
                          "released_after_s": wait_until(lambda: rid not in leases(args.p_kvd), 30, f"release of {rid}")}
    # A pull D's daemon refuses outright (the params name D's own engine): the
    # worker's step does not wait for that answer, so a later step reports the
    # load failed, and D computes the prompt itself.
    pre = generate(p, pd_prompts[0], sampling(1, {"do_remote_decode": True}))
    params = {**pre.kv_transfer_params, "remote_engine_id": status(args.d_kvd).engine_id}
    out["refused_load"] = {"tokens": list(generate(d, pd_prompts[0], sampling(args.max_tokens, params)).outputs[0].token_ids)}
    # Negative control, last: P's cache zeroed between prefill and decode.
    pre = generate(p, control, sampling(1, {"do_remote_decode": True}))
    wait_until(lambda: pre.kv_transfer_params["remote_request_id"] in leases(args.p_kvd), 10, "publication")
    out["corrupted_bytes"] = corrupt_prefill_cache(args.p_kvd)
    out["corrupted_tokens"] = list(generate(d, control, sampling(args.max_tokens, pre.kv_transfer_params)).outputs[0].token_ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["make-model", "baseline", "pd", "hetero"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="", help="JSON file: a list of token-id lists")
    ap.add_argument("--out", default="")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--p-kvd", default="")
    ap.add_argument("--d-kvd", default="")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=0, help="baseline")
    ap.add_argument("--p-tp", type=int, default=1)
    ap.add_argument("--d-tp", type=int, default=1)
    ap.add_argument("--p-pp", type=int, default=1)
    ap.add_argument("--d-pp", type=int, default=1)
    ap.add_argument("--p-block-size", type=int, default=0)
    ap.add_argument("--d-block-size", type=int, default=0)
    ap.add_argument("--d-metrics", default="", help="hetero: D daemon's /metrics URL, read after each request")
    ap.add_argument("--sliding-window", type=int, default=0, help="make-model: a hybrid of a windowed and a full layer")
    ap.add_argument("--family", default="llama", help="make-model: the tiny Llama, a model with state (HYBRIDS), or zoo:NAME (tests/zoo.py)")
    ap.add_argument("--baseline-prompts", default="", help="hetero: JSON prompts D computes alone first (its tokens: baseline_tokens)")
    ap.add_argument("--llm-kw", type=json.loads, default={}, help="JSON: more LLM arguments for every engine (enable_prefix_caching, ...)")
    args = ap.parse_args()
    if args.mode == "make-model":
        if args.family == "llama":
            make_model(Path(args.model), args.sliding_window)
        elif args.family.startswith("zoo:"):
            from tests.zoo import zoo_model

            zoo_model(Path(args.model), args.family.removeprefix("zoo:"))
        else:
            make_hybrid(Path(args.model), args.family)
        return
    prompts = json.loads(Path(args.prompts).read_text())
    t0 = time.monotonic()
    if args.mode == "baseline":
        llm = engine(args.model, None, None, block_size=args.block_size or None, dtype=args.dtype, llm_kw=args.llm_kw)
        result: dict[str, Any] = {"tokens": [list(generate(llm, pr, sampling(args.max_tokens)).outputs[0].token_ids) for pr in prompts]}
    elif args.mode == "hetero":
        result = run_hetero(args, prompts)
    else:
        result = run_pd(args, prompts)
    result["seconds"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

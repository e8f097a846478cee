"""The model zoo: tiny random-weight models whose structure is copied from the
public configs of models people serve, with only the widths made small.

Kept exactly from each source: the architecture, attention heads, KV heads and
head_dim (so the GQA ratio and every KV cache page), the layer pattern (which
layers attend, slide or hold state, hence vLLM's KV cache groups), window
sizes and attention sinks, Mamba2's heads, head_dim, ``n_groups``, d_state,
conv kernel and chunk size, gated delta-net's key and value heads and dims,
and the MoE expert counts. Made small: hidden and MLP/expert widths, the
vocabulary, and the depth where the layer pattern repeats (each model keeps
at least one period, so the same number of KV cache groups where noted).

Each entry names its source config and how it was read (the research is in
the git log of this file); ``zoo_model`` writes one, with scaled random
weights (transformers' init, then scaled so the tokens depend on the cache).
Used by tests/test_vllm_zoo.py and, for Granite 4.0-H, tests/test_vllm_state.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMON = {"vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}


@dataclass(frozen=True)
class ZooModel:
    arch: str
    source: str  # the public config the structure comes from
    config: dict[str, Any]
    state: bool = False  # Mamba or gated delta-net layers (prefix caching off, as kvd requires)
    dtype: str = "float32"  # the oracle's: one engine and P/D agree exactly in float32
    tp2: bool = True  # TP2 splits every head evenly (or replicates it as vLLM does)
    prompts: tuple[int, ...] = (300, 129)  # prompt lengths
    kv_cache_mib: int = 64
    notes: str = ""
    scale: dict[str, float] = field(default_factory=dict)  # parameter-name suffix -> factor


ZOO: dict[str, ZooModel] = {
    "llama3": ZooModel(
        "LlamaForCausalLM", "meta-llama/Llama-3.1-8B-Instruct",
        {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    ),
    "qwen3": ZooModel(
        "Qwen3ForCausalLM", "Qwen/Qwen3-8B",
        {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
         "hidden_act": "silu", "attention_bias": False, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 2},
    ),
    "gemma3": ZooModel(
        "Gemma3ForCausalLM", "google/gemma-3-1b-it",
        {"model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 26, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
         "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
         "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000, "max_position_embeddings": 32768,
         "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True},
        tp2=False, prompts=(700, 300),
        notes="MQA (1 KV head); 26 layers keep the 7 KV cache groups; the 700-token prompt crosses the 512-token window. "
              "Not in the TP2 pairs: a TP2 and a TP1 engine alone differ on that prompt in float32 (token 4), so one "
              "engine is no oracle; measured, P/D across TP gives P alone's tokens exactly, both ways",
    ),
    "gpt_oss": ZooModel(
        "GptOssForCausalLM", "openai/gpt-oss-20b",
        {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 64,
         "num_key_value_heads": 8, "head_dim": 64, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 128,
         "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9,
         "attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 150000,
         "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 4096, "truncate": False},
         "max_position_embeddings": 131072, "initial_context_length": 4096},
        notes="attention sinks; unquantized (MXFP4 MoE needs AMX on CPU)",
    ),
    "granite4h": ZooModel(
        "GraniteMoeHybridForCausalLM", "ibm-granite/granite-4.0-h-tiny",
        {"model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 10,
         "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 4, "num_attention_heads": 12, "num_key_value_heads": 4,
         "position_embedding_type": "nope", "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
         "num_local_experts": 64, "num_experts_per_tok": 6, "intermediate_size": 32, "shared_intermediate_size": 64,
         "embedding_multiplier": 1.0, "attention_multiplier": 0.0078125, "residual_multiplier": 1.0, "logits_scaling": 1.0,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False},
        state=True, kv_cache_mib=256,
        notes="mamba_n_groups=1: at TP2 vLLM replicates B and C; hidden stays 1536 (vLLM takes head_dim as hidden / heads); "
              "10 layers: one period of the 40 (attention at 5)",
    ),
    "falcon_h1": ZooModel(
        "FalconH1ForCausalLM", "tiiuae/Falcon-H1-0.5B-Instruct",
        {"model_type": "falcon_h1", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "attn_layer_indices": None, "mamba_d_ssm": 1536, "mamba_n_heads": 24,
         "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 128, "mamba_expand": 2,
         "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_norm_before_gate": False,
         "mamba_use_mlp": True, "projectors_bias": False, "attention_bias": False, "mlp_bias": False, "rope_theta": 1e11,
         "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
        state=True, kv_cache_mib=256, notes="attention and Mamba2 in every layer (parallel hybrid); mamba_n_groups=1",
    ),
    "nemotron_h": ZooModel(
        "NemotronHForCausalLM", "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        {"model_type": "nemotron_h", "hidden_size": 128, "intermediate_size": 256, "hybrid_override_pattern": "M-M-M-M-M-M-M*-",
         "num_hidden_layers": 15, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
         "mamba_head_dim": 80, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "expand": 2,
         "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_conv_bias": True, "mamba_proj_bias": False, "use_bias": False,
         "mlp_bias": False, "attention_bias": False, "layer_norm_epsilon": 1e-5, "residual_in_fp32": False,
         "max_position_embeddings": 131072},
        state=True, kv_cache_mib=384, notes="Mamba head_dim 80; 15 layers keep its 8 KV cache groups",
    ),
    "qwen3_next": ZooModel(
        "Qwen3NextForCausalLM", "Qwen/Qwen3-Next-80B-A3B-Instruct",
        {"model_type": "qwen3_next", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 16, "num_key_value_heads": 2,
         "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000, "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False},
        state=True, dtype="bfloat16", kv_cache_mib=256,
        notes="gated delta-net runs in bf16 only on CPU: the oracle is NixlConnector's P/D on the same prompts",
    ),
    "mamba2": ZooModel(
        "Mamba2ForCausalLM", "mistralai/Mamba-Codestral-7B-v0.1",
        {"model_type": "mamba2", "hidden_size": 256, "expand": 32, "num_hidden_layers": 2, "num_heads": 128, "head_dim": 64,
         "n_groups": 8, "state_size": 128, "conv_kernel": 4, "chunk_size": 256, "use_bias": False, "use_conv_bias": True,
         "rms_norm": True, "norm_before_gate": True, "residual_in_fp32": True, "layer_norm_epsilon": 1e-5, "hidden_act": "silu"},
        state=True, kv_cache_mib=128,
    ),
}


def zoo_model(d: Path, name: str) -> None:
    """Write ``ZOO[name]`` to ``d``: its config, scaled random weights (bf16)
    and a word-per-id tokenizer. Runs under the vLLM environment's Python
    (transformers builds the model as it defines it)."""
    import torch
    import transformers

    from tests.vllm_driver import make_tokenizer

    m = ZOO[name]
    fields = {**COMMON, **m.config}
    model_type = fields.pop("model_type")
    torch.manual_seed(0)
    c = transformers.AutoConfig.for_model(model_type, initializer_range=0.08, **fields)
    c.architectures = [m.arch]
    model = transformers.AutoModelForCausalLM.from_config(c).to(torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Make the cache matter: sharp attention, and state that lasts
            # (a token 250 back still counts) and reaches the logits.
            if pname.endswith("A_log"):
                p.fill_(float(torch.log(torch.tensor(0.001))))
            elif pname.endswith("dt_bias"):
                p.fill_(0.5)
            elif pname.endswith(("q_proj.weight", "k_proj.weight", "in_proj.weight", "out_proj.weight", "in_proj_qkvz.weight")):
                p.mul_(3.0)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                # QK-norm (Qwen3, Gemma 3) undoes a scaled projection: scale the norm instead
                # (Gemma's weights are offsets from 1, at 0).
                p.fill_(3.0) if not p.any() else p.mul_(3.0)
    d.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(d), safe_serialization=True)
    make_tokenizer(d, 1000)
    (d / "zoo.json").write_text(json.dumps({"name": name, "source": m.source}))

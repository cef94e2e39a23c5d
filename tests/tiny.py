"""Tiny random-weight transformers models for tests (no downloads)."""
from __future__ import annotations

import dataclasses
import os
import threading

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

ARCHS = ("llama", "mistral", "qwen2")
# decoders that differ from those in their MLP (mixture of experts) or their names and norms (tests/test_architectures.py)
MORE_ARCHS = ("qwen3_moe", "mixtral", "phi3", "olmo2")


def tiny_model(arch: str = "llama", layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               seed: int = 0, sliding_window: int | None = None):
    """`sliding_window` (Mistral and Mixtral): the config's window, as Mistral-7B-v0.1 sets 4096."""
    common = dict(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=1024, attn_implementation="sdpa", pad_token_id=0, eos_token_id=1,
                  bos_token_id=2)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    elif arch == "qwen3_moe":  # every layer's MLP is 4 experts, 2 per token
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   decoder_sparse_step=1, **common))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=sliding_window, **common))
    elif arch == "phi3":  # one fused qkv_proj; head_dim is hidden_size / heads
        model = Phi3ForCausalLM(Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}))
    elif arch == "olmo2":  # RMS norms over the whole q and k projections, after the attention and MLP
        model = Olmo2ForCausalLM(Olmo2Config(**common))
    else:
        raise ValueError(arch)
    peaked(model)
    model.generation_config.pad_token_id = 0
    return model.eval()


def peaked(model) -> None:
    """Larger random weights than the default init give peaked, varied attention, so that
    policies disagree about which tokens matter (the default init attends almost uniformly)."""
    config = model.config
    rows = (config.num_attention_heads + config.num_key_value_heads) * \
        (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):  # RMS-normed queries and keys (Qwen3, OLMo 2): the norms' weights (the
                attn.q_norm.weight.mul_(2)  # normed entries are ~1 each, far larger than the projections')
                attn.k_norm.weight.mul_(2)
            elif hasattr(attn, "qkv_proj"):  # rows: the queries, then the keys, then the values
                attn.qkv_proj.weight[:rows].mul_(8)
            else:
                attn.q_proj.weight.mul_(8)
                attn.k_proj.weight.mul_(8)


def prompt(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, n), generator=g)


def left_pad(seqs: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = s
        mask[i, n - len(s):] = 1
    return ids, mask


# --- where a test runs a Triton kernel ---------------------------------------------------------

def triton_device() -> torch.device:
    """The GPU where Triton runs for real, else the CPU under Triton's interpreter (conftest.py
    switches it on where no CUDA device is present). Without the interpreter Triton refuses CPU
    tensors, so a test of a Triton kernel puts its inputs here (`on_triton`) and reads the result
    back with `.cpu()`."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


def to_device(x, device: torch.device):
    """Tensors, also inside tuples, lists, NamedTuples and dataclasses, moved to `device`; anything else as is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: to_device(getattr(x, f.name), device)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(item, device) for item in x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(item, device) for item in x)
    return x


def on_triton(impl: str | None, *xs):
    """`xs` moved to `triton_device()` when impl is "triton", else as they are (a tuple either way)."""
    return tuple(to_device(x, triton_device()) if impl == "triton" else x for x in xs)


def run_threads(jobs):
    """Run each job (a callable) on its own thread, started together; their results in order."""
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def run(i):
        try:
            start.wait()
            results[i] = jobs[i]()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results

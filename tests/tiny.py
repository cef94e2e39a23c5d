"""Tiny random-weight transformers models for tests (no downloads)."""
from __future__ import annotations

import os
import threading

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

ARCHS = ("llama", "mistral", "qwen2")


def tiny_model(arch: str = "llama", layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               seed: int = 0, sliding_window: int | None = None):
    """`sliding_window` (Mistral only): the config's window, as Mistral-7B-v0.1 sets 4096."""
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
    else:
        raise ValueError(arch)
    # Larger random weights than the default init give peaked, varied attention, so that
    # policies disagree about which tokens matter (the default init attends almost uniformly).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.generation_config.pad_token_id = 0
    return model.eval()


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
    """Tensors, also inside tuples, lists and NamedTuples, moved to `device`; anything else as is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
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

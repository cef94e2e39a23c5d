"""`kvcompile serve --engine vllm`: vLLM's OpenAI-compatible server with the plugin configured
(docs/VLLM.md). Run from the vLLM environment (.venv-vllm/bin/kvcompile), where vLLM is installed."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

BLOCK_SIZE = 128  # vLLM's CPU default


@dataclass(frozen=True)
class VllmServe:
    spec: str
    per_head: int | None
    model: str
    host: str
    port: int
    kv_tokens: int
    max_model_len: int
    served_model_name: str | None = None

    def argv(self) -> list[str]:
        """vLLM's server command: the settings the plugin needs (prefix caching off), chunked prefill off (a
        whole prompt per step, as benchmarks/bench_vllm.py measures; the plugin also runs with it on), fp32
        eager on the CPU, a KV pool of kv_tokens tokens in whole blocks."""
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                "--max-model-len", str(self.max_model_len), "--max-num-batched-tokens", str(self.max_model_len),
                "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(-(-self.kv_tokens // BLOCK_SIZE))]
        # as kvcompile's own server: the folder's name, the path as given accepted too (vLLM answers with the first)
        from kvcompile.integrations.server import default_model_name

        names = [self.served_model_name] if self.served_model_name else \
            list(dict.fromkeys([default_model_name(self.model), self.model]))
        return argv + ["--served-model-name", *names]

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPILE_VLLM_")}
        env["KVCOMPILE_VLLM_SPEC"] = self.spec
        if self.per_head is not None:
            env["KVCOMPILE_VLLM_PER_HEAD"] = str(self.per_head)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the pool is --num-gpu-blocks-override blocks; this is its bound
        return env

    def check(self) -> None:
        """Refuse, before vLLM starts, what the plugin refuses (PluginError) and a missing vLLM (ImportError)."""
        import importlib.util

        from kvcompile.integrations.vllm.settings import check_policy, from_env

        if importlib.util.find_spec("vllm") is None:
            raise ImportError("kvcompile: --engine vllm needs vLLM in this environment "
                              "(bash scripts/setup.sh vllm; then .venv-vllm/bin/kvcompile serve --engine vllm)")
        check_policy(from_env(self.env()).policy())

    def banner(self) -> str:
        """What `kvcompile serve --engine vllm` prints before vLLM's own log: the plugin, its spec, the address."""
        from kvcompile.integrations.vllm.settings import active_message, from_env

        settings = from_env(self.env())
        return (f"kvcompile serve --engine vllm: {active_message(settings, settings.policy())}; vLLM's OpenAI "
                f"server for {self.model} on http://{self.host}:{self.port}/v1, KV pool {self.kv_tokens} tokens, "
                f"max model length {self.max_model_len} (vLLM's log follows; each of its processes logs the plugin "
                "line again as it loads it)")

    def exec(self) -> None:
        self.check()
        print(self.banner(), flush=True)
        os.execve(self.argv()[0], self.argv(), self.env())

"""Soak of `kvcompile serve` (issue 25), bounded: a tiny model served in this process on a thread (127.0.0.1,
one uvicorn server, no other process), 8 clients sending 3 rounds of a random mix (benchmarks/soak.py:
completions and chats, greedy or sampled with a seed, stop strings, streams, invalid bodies, streams dropped
mid-way, prompts the pool can never hold, prompts past the context, pathological values: a temperature of
1e-300, seeds beyond int64, lone UTF-16 surrogates, a 4 MiB prompt, a top_p of 1e-300) into a pool small enough
that requests are soft-reset and replayed. At the end: every valid answer equals generate() for its request, every invalid
one got its 400 naming its field, the server still answers, every block is back in the pool, the engine holds
no request's state, and RSS after the last round is within a bound of RSS after the first.
"""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="kvcompile serve needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="kvcompile serve needs fastapi and uvicorn")
requests = pytest.importorskip("requests")

import kvcompile  # noqa: E402
from kvcompile.integrations.server import KVCompileServer, ServeOptions  # noqa: E402
from tests.test_serve_http import SPEC, char_tokenizer, free_port  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

spec = importlib.util.spec_from_file_location("soak", Path(__file__).parent.parent / "benchmarks" / "soak.py")
soak_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak_module)

CLIENTS, PER_ROUND, ROUNDS = 8, 4, 3  # 96 requests
RSS_GROWTH_MIB = 64  # what the later rounds may add to the process's RSS (a leak of the engine's requests'
#   caches, sampling or handlers, or of the server's jobs, grows it with every round)


def test_soak(tmp_path):
    folder = tmp_path / "tiny-soak"
    tokenizer = char_tokenizer()
    model = tiny_model()
    model.resize_token_embeddings(len(tokenizer))
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    model.config.max_position_embeddings = 2048
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    policy = kvcompile.load_spec("snapkv", **SPEC)
    # 1024 tokens of pool, 64 per forward: a 1100-token prompt can never be held, concurrent decodes preempt
    server = KVCompileServer(ServeOptions(spec=policy, model=str(folder), port=free_port(), kv_tokens=1024,
                                          max_batch_tokens=64, log_level="error", log_requests=False))
    server.start()
    try:
        server.wait_started(timeout=60)
        soak = soak_module.Soak(f"http://127.0.0.1:{server.options.port}", str(folder), tokenizer,
                                server.cache.pool_tokens(), server.context, 64, max_tokens=16, timeout=120)
        rss = []
        for round_ in range(ROUNDS):
            soak.run(CLIENTS, seed=round_, requests_per_client=PER_ROUND)
            soak_module.wait_idle(server)
            rss.append(soak_module.rss_mib())
        assert requests.get(f"{soak.base}/health", timeout=10).json() == {"status": "ok"}
        metrics = soak_module.wait_idle(server)
        state = server.cache.kvcompile
        router = server.manager.output_router
    finally:
        server.stop()
    kinds = {s.kind for s in soak.sent}
    assert {"greedy", "chat", "sampled", "stop", "stream", "invalid", "cancel", "oversize", "pathological"} <= kinds
    assert {s.expect_param for s in soak.sent if s.kind == "pathological"} >= {"temperature", "seed", "prompt"}
    bad = [(s.kind, s.body, s.status, s.error) for s in soak.sent if s.outcome not in ("ok", "refused", "cancelled")]
    assert not bad, bad[:5]
    checked, wrong = soak.check(server.model)
    assert checked >= CLIENTS * PER_ROUND and not [(s.kind, s.body, s.text) for s in wrong]
    assert metrics["blocks_free"] == metrics["blocks_total"] and metrics["failed_engine_steps"] == 0
    assert not state.requests and not state.sampling and not state.admitted and not state.replays
    assert not router.result_handlers
    assert rss[-1] - rss[0] < RSS_GROWTH_MIB, rss

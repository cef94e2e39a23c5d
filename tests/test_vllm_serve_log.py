"""`kvcompile serve --engine vllm` and the vLLM plugin say that kvcompile's plugin is active and with which spec
(issue 39): the line `serve` prints before it hands over to vLLM, and the line the plugin logs in each vLLM process
as it loads. Neither needs vLLM: `serve`'s exec and the plugin's patches are replaced here."""
import logging
import sys
import types

import pytest

from kvcompile.integrations.vllm.serve import VllmServe


def serve_options(**changes) -> VllmServe:
    options = dict(spec="snapkv", per_head=64, model="models/smollm2-135m", host="127.0.0.1", port=8123,
                   kv_tokens=8192, max_model_len=1024)
    return VllmServe(**{**options, **changes})


def test_serve_engine_vllm_prints_the_plugin_and_its_spec_before_vllm_starts(monkeypatch, capsys):
    server = serve_options()
    started = []
    monkeypatch.setattr(VllmServe, "check", lambda self: None)
    monkeypatch.setattr("os.execve", lambda path, argv, env: started.append((argv, env)))
    server.exec()
    out = capsys.readouterr().out
    assert "kvcompile's vLLM plugin is active" in out and "spec 'snapkv', per_head=64" in out
    assert "policy snapkv" in out and "http://127.0.0.1:8123/v1" in out and "8192 tokens" in out
    (argv, env), = started  # printed, then vLLM started with the plugin's settings in its environment
    assert env["KVCOMPILE_VLLM_SPEC"] == "snapkv" and env["KVCOMPILE_VLLM_PER_HEAD"] == "64"
    spec_budget = serve_options(spec="streamingllm", per_head=None).banner()  # the spec's own budget
    assert "spec 'streamingllm' -> policy streamingllm" in spec_budget


@pytest.fixture
def plugin_without_vllm(monkeypatch):
    """register() with the spec in the environment and vLLM's patching replaced (records what it applied)."""
    applied = []
    monkeypatch.setitem(sys.modules, "kvcompile.integrations.vllm.patches", types.SimpleNamespace(apply=applied.append))
    monkeypatch.setenv("KVCOMPILE_VLLM_SPEC", "snapkv")
    monkeypatch.setenv("KVCOMPILE_VLLM_PER_HEAD", "32")
    monkeypatch.delenv("KVCOMPILE_VLLM_RATIO", raising=False)
    from kvcompile.integrations.vllm import register

    return register, applied


def test_the_plugin_logs_that_it_is_active_on_vllms_logger(plugin_without_vllm, caplog):
    register, applied = plugin_without_vllm
    with caplog.at_level(logging.INFO, logger="vllm"):
        register()
    assert [p.name for p in applied] == ["snapkv"]
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvcompile"]
    assert len(lines) == 1 and "plugin is active" in lines[0] and "spec 'snapkv', per_head=32" in lines[0]


def test_the_plugin_says_it_is_active_on_stderr_where_logging_is_not_configured(plugin_without_vllm, monkeypatch,
                                                                                capsys):
    register, applied = plugin_without_vllm
    monkeypatch.setattr(logging.Logger, "hasHandlers", lambda self: False)
    register()
    err = capsys.readouterr().err
    assert "kvcompile: kvcompile's vLLM plugin is active: spec 'snapkv', per_head=32 -> policy snapkv" in err


def test_vllm_serves_the_folders_name_as_kvcompiles_server_does():
    argv = serve_options().argv()
    assert argv[argv.index("--served-model-name") + 1:][:2] == ["smollm2-135m", "models/smollm2-135m"]
    named = serve_options(served_model_name="mine").argv()
    assert named[named.index("--served-model-name") + 1:] == ["mine"]

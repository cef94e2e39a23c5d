"""vLLM beside kvcompile (docs/VLLM.md): the environment `bash scripts/setup.sh vllm` makes
(.venv-vllm, part of `setup.sh all`) imports both; there vLLM's transformers stays, kvcompile's policies,
plans and kernels run, and compile() refuses that transformers by name. (vLLM's greedy tokens on the
embedded SmolLM2 equal transformers' generate() in kvcompile's own environment: tests/test_vllm_plugin.py,
test_budget_covering_the_prompt_equals_plain_vllm.) Each check runs in a subprocess of that environment,
bounded in time."""
from __future__ import annotations

import torch

from vllm_venv import ROOT, in_vllm_env, needs_vllm

pytestmark = needs_vllm


REPLAY = """
import torch, kvcompile
from types import SimpleNamespace
from kvcompile.layer_state import LayerState
from kvcompile.tools.sweep import replay
def kept(name):
    g = torch.Generator().manual_seed(0)
    states = [LayerState(torch.randn(1, 4, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g),
                         torch.randn(1, 2, 70, 16, generator=g)) for _ in range(3)]
    config = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return replay(kvcompile.load_spec(name, per_head=40), config, states).kept().tolist()
"""


def test_vllm_and_kvcompile_import_together_and_compile_refuses_the_transformers():
    """In the vLLM environment: vLLM 0.32 and this checkout's kvcompile import; the three wheels that do not
    load beside this torch are gone; a policy's selection runs there and keeps what it keeps here; compile()
    refuses vLLM's transformers by name."""
    out = in_vllm_env(REPLAY + """
import importlib.util, json, transformers, vllm
from tiny import tiny_model
try:
    kvcompile.compile(tiny_model("llama"), "snapkv")
    refusal = None
except kvcompile.CompileError as exc:
    refusal = str(exc)
print("RESULT" + json.dumps({"vllm": vllm.__version__, "torch": torch.__version__,
      "transformers": transformers.__version__, "kvcompile": kvcompile.__file__, "refusal": refusal,
      "kept": {name: kept(name) for name in ("snapkv", "lava")},
      "absent": [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m) is None]}))
""", timeout=300)
    here = {}
    exec(REPLAY, here)
    assert out["vllm"] == "0.32.0" and out["torch"] == torch.__version__
    assert out["kvcompile"].startswith(str(ROOT / "kvcompile"))  # this checkout, installed editable
    assert out["absent"] == ["torchvision", "torchaudio", "torchcodec"]
    assert out["kept"] == {name: here["kept"](name) for name in ("snapkv", "lava")}
    assert out["refusal"] is not None and f"this environment has transformers {out['transformers']}" in out["refusal"]

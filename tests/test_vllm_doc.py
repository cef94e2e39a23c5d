"""docs/VLLM.md's first `LLM(...)` snippet is a whole script that runs as written on a shared CPU machine (issue 39):
it builds `LLM(...)` only under the `if __name__ == "__main__":` guard (vLLM's engine core is a spawned child
process that imports the script again) and bounds the KV cache's memory (vLLM's CPU default reserves 90% of the
machine and refuses to start where less is free). Read from the doc's text, without vLLM."""
import ast
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "VLLM.md"


def first_llm_snippet() -> str:
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    first_llm = text.index("LLM(")
    snippet = next((b for b in blocks if "LLM(" in b), None)
    assert snippet is not None and text.index(snippet) < first_llm, "the first LLM(...) in the doc is not a script"
    return snippet


def test_the_first_llm_snippet_builds_the_engine_under_a_main_guard_with_bounded_memory():
    tree = ast.parse(first_llm_snippet())
    guard = next(node for node in tree.body if isinstance(node, ast.If))
    assert ast.unparse(guard.test) == "__name__ == '__main__'"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "LLM"]
    assert calls and all(any(c is n for n in ast.walk(guard)) for c in calls)  # every LLM(...) under the guard
    settings = {k.arg: eval(compile(ast.Expression(k.value), "snippet", "eval"), {"__builtins__": {}})  # constants
                for k in calls[0].keywords}
    assert 0 < settings["kv_cache_memory_bytes"] <= 4 << 30
    assert settings["enable_prefix_caching"] is False
    top_level = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.If))]
    assert not top_level  # nothing but imports runs again in the engine core's child process

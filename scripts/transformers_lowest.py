"""The lowest transformers that pyproject.toml allows, installed beside the project so the tests can run
against it (tests/test_transformers_range.py). The version is pyproject's lower bound, read here: it is
written nowhere else.

    python3 scripts/transformers_lowest.py            # print the version
    python3 scripts/transformers_lowest.py requirement  # print pyproject's transformers requirement
    python3 scripts/transformers_lowest.py install    # .transformers-lowest/: a virtual environment with
                                                      # that transformers (and what it needs that differs)

`bash scripts/setup.sh test` (and `all`) runs `install`. The environment sees every package of the Python
that made it (torch, accelerate, pytest...): only transformers and the dependencies its version pins
differently (huggingface_hub, tokenizers...) are its own, so a test run there differs from the usual one
by the transformers version alone.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / ".transformers-lowest"


def requirement(pyproject: Path = ROOT / "pyproject.toml"):
    """pyproject's transformers dependency (a packaging Requirement)."""
    from packaging.requirements import Requirement

    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(line)
        if req.name == "transformers":
            return req
    raise ValueError(f"{pyproject}: no transformers dependency")


def lowest_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The X of pyproject's `transformers>=X,...` dependency."""
    req = requirement(pyproject)
    lows = [s.version for s in req.specifier if s.operator == ">="]
    if len(lows) != 1:
        raise ValueError(f"{pyproject}: the transformers dependency {str(req)!r} names no single lower bound (>=)")
    return lows[0]


def python(folder: Path = FOLDER) -> Path:
    """The environment's interpreter."""
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed(folder: Path = FOLDER) -> tuple[str, str] | None:
    """(version, folder) of the transformers that the environment imports, or None where it is not set up."""
    if not python(folder).exists():
        return None
    done = subprocess.run([str(python(folder)), "-c", "import transformers, os; "
                           "print(transformers.__version__); print(os.path.dirname(transformers.__file__))"],
                          capture_output=True, text=True)
    if done.returncode:
        return None
    version, path = done.stdout.split("\n")[-3:-1]
    return version, path


def install(folder: Path = FOLDER) -> str:
    """Make (or bring up to date) the environment with pyproject's lowest transformers; its version."""
    from packaging.version import Version

    version = lowest_version()
    if not python(folder).exists() or subprocess.run([str(python(folder)), "-c", "pass"]).returncode:
        shutil.rmtree(folder, ignore_errors=True)
        # no pip or setuptools of its own: this Python's serve it (pip installs into the running environment)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    # This Python's packages, after the environment's own (which then hold only what differs). A .pth
    # line that imports runs at start-up: addsitedir also reads those folders' .pth files (editable installs).
    parents = [p for p in [*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"]]
               if Path(p).is_dir()]
    own = subprocess.run([str(python(folder)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(parents) if p != own)
    Path(own, "_kvcompile_parent.pth").write_text(lines)
    subprocess.run([str(python(folder)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"transformers=={version}"], check=True)
    got = installed(folder)
    if got is None or Version(got[0]) != Version(version) or \
            not Path(got[1]).resolve().is_relative_to(folder.resolve()):
        raise RuntimeError(f"{folder}: transformers {version} was installed but the environment imports {got}")
    return version


def main(argv: list[str]) -> None:
    if argv == ["install"]:
        print(f"transformers {install()} (pyproject's lowest) in {FOLDER.relative_to(ROOT)}/")
    elif argv == ["requirement"]:
        print(requirement())
    elif not argv:
        print(lowest_version())
    else:
        sys.exit(f"usage: python3 {Path(__file__).name} [install|requirement]")


if __name__ == "__main__":
    main(sys.argv[1:])

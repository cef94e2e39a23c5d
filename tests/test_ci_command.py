"""CI runs exactly the README's test command (.ci/run's last line is README's line that runs pytest), and that
command shows which test file runs: pytest's default output, one line per file, not `-q`'s bare dots."""
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if "-m pytest" in line]
    assert lines, "README.md shows no test command"
    return lines[0].strip()


def test_ci_runs_exactly_the_readmes_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == readme_test_command()


def test_the_test_command_prints_a_line_per_test_file():
    pytest_args = readme_test_command().split("-m pytest", 1)[1]
    quiet = {"-q", "--quiet", "-qq"}
    assert not quiet & set(shlex.split(pytest_args)), "-q prints only dots: nobody can tell which file runs"

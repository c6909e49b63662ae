"""The README's two set-up commands exist, and CI runs exactly the test one."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith("python3 -m venv .venv")
    assert f"\n{ci_command}\n" in readme


def test_readme_main_command_installs_with_the_cpu_torch_pin():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e . && .venv/bin/sparserl compare --out runs/default" in readme
    assert (ROOT / "constraints.txt").read_text().strip() == "torch==2.13.0"

"""The README's Quick start stays what the project promises: two commands on a fresh machine, one that installs and
runs the main job (an entry point of the package), one that installs and runs the tests, which is what CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S)
    assert block, "the README has no Quick start bash block"
    commands = block.group(1).strip().splitlines()
    assert len(commands) == 2, commands
    main_job, tests = (command.split(" && ") for command in commands)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert main_job[0].startswith("pip install ") and main_job[-1].split()[0] in scripts, main_job
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    install = next(line for line in ci if " pip install " in line)
    assert tests[0].removeprefix("pip install ") in install, (tests, install)  # the same install, pip's flags aside
    assert ci[-1] == tests[-1], (ci[-1], tests)

"""benchmarks/gpu_session.sh, the one prepared run for a GPU session (rare, and limited to one 600 s device
call): checked on the CPU, so a typo does not cost it. Every step runs a test file or benchmark that exists,
with flags its parser accepts, within the time the call allows."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
DEVICE_CALL_S = 600  # the device tool's limit on one command
START_UP_S = 30  # nvidia-smi, imports, packing the results
SECOND_CALL_S = 210  # what a session's 900 s of device time may leave after the first call and the machine's start


def _steps() -> list[list[str]]:
    """Each ``step NAME SECONDS COMMAND...`` line, split as the shell would (continuations joined)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [shlex.split(line.replace('"$RES"', "OUT")) for line in text.splitlines() if line.startswith("step ")]


def _benchmark(path: Path):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_call() -> list[str]:
    """The steps a call runs by default (the script's ``STEPS``)."""
    line = next(line for line in SCRIPT.read_text().splitlines() if line.startswith('STEPS="'))
    return line.split(":-", 1)[1].split("}", 1)[0].split()


def test_every_step_exists_and_parses_within_the_device_call():
    steps = _steps()
    first = _first_call()
    assert first == ["decode_tests", "engine", "decode_kernels", "e2e", "lm_head", "model_op_tests"]
    assert [s[1] for s in steps] == first + ["training_tests", "training"]  # the second call's last
    for _, name, _, *command in steps:
        assert command[0] == "python3", name
        if command[1:3] == ["-m", "pytest"]:
            files = [a.partition("::") for a in command[3:] if a.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f, _, _ in files), name
            assert all(f"def {test}(" in (ROOT / f).read_text() for f, _, test in files if test), name
        else:
            args = _benchmark(ROOT / command[1]).parse_args(command[2:])
            assert str(args.out) == "OUT", name
    assert sum(int(s[2]) for s in steps if s[1] in first) + START_UP_S <= DEVICE_CALL_S
    assert sum(int(s[2]) for s in steps if s[1] not in first) + START_UP_S <= SECOND_CALL_S


def test_a_call_runs_only_the_steps_it_names(tmp_path):
    """The second argument selects the steps: a name that is no step runs none (on this CPU: nvidia-smi is missing,
    which the script tolerates), and the call still writes the targets table and packs the results."""
    import subprocess

    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "no_such_step"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MRP_COMMIT": "abc1234"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "===" not in out.stdout
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["gpu.txt", "targets.md"]
    assert "commit abc1234" in (tmp_path / "results" / "gpu.txt").read_text()  # the device's copy has no .git
    assert (tmp_path / "gpu_results.tar.gz").is_file()

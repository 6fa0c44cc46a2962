"""benchmarks/gpu_session.sh, the one prepared run for a GPU session (rare, and limited to one 600 s device
call): checked on the CPU, so a typo does not cost it. Every step runs a test file or benchmark that exists,
with flags its parser accepts, within the time the call allows."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
DEVICE_CALL_S = 600  # the device tool's limit on one command
START_UP_S = 30  # nvidia-smi, imports, packing the results


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


def test_every_step_exists_and_parses_within_the_device_call():
    steps = _steps()
    assert [s[1] for s in steps] == ["decode_tests", "engine", "decode_kernels", "e2e", "lm_head", "model_op_tests"]
    for _, name, _, *command in steps:
        assert command[0] == "python3", name
        if command[1:3] == ["-m", "pytest"]:
            files = [a.partition("::") for a in command[3:] if a.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f, _, _ in files), name
            assert all(f"def {test}(" in (ROOT / f).read_text() for f, _, test in files if test), name
        else:
            args = _benchmark(ROOT / command[1]).parse_args(command[2:])
            assert str(args.out) == "OUT", name
    assert sum(int(s[2]) for s in steps) + START_UP_S <= DEVICE_CALL_S

"""The CI scripts name tests that exist: a test id in .ci/gpu_stack that no longer matches a test function would
make pytest fail there, on CI only (the GPU-stack check does not run in a developer's `make test`)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / ".ci" / "gpu_stack", ROOT / ".ci" / "run"]
TEST_ID = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def named_tests(script: Path):
    return TEST_ID.findall(script.read_text())


def test_the_scripts_name_tests():
    assert named_tests(ROOT / ".ci" / "gpu_stack"), "the pattern finds the GPU-stack check's test ids"


def test_every_test_id_in_the_ci_scripts_exists():
    missing = []
    for script in SCRIPTS:
        for path, name in named_tests(script):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{script.name}: {path}")
            elif name and not re.search(rf"^def {name}\(", source.read_text(), re.M):
                missing.append(f"{script.name}: {path}::{name}")
    assert not missing, missing

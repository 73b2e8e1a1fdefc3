"""The CI scripts name tests that exist: a test id in .ci/gpu_stack that no longer matches a test function would
make pytest fail there, on CI only (the GPU-stack check does not run in a developer's `make test`)."""
import importlib.util
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


def test_the_files_the_suite_starts_with_exist():
    """tests/conftest.py's LONGEST_FILES (the files make test starts first) and the Makefile's FAST_IGNORE (the
    files make test-fast leaves out) name files that exist: a renamed or split file would silently fall back to
    the usual order, or into the inner loop."""
    # by path: under pytest-xdist another directory's conftest module can hold the name "conftest"
    spec = importlib.util.spec_from_file_location("lantern_tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    LONGEST_FILES = conftest.LONGEST_FILES

    makefile = (ROOT / "Makefile").read_text()
    ignored = re.findall(r"--ignore=(\S+)", makefile)
    globs = re.findall(r"--ignore-glob='([^']+)'", makefile)
    assert ignored and globs, "the patterns find the Makefile's FAST_IGNORE"
    missing = [path for path in (*LONGEST_FILES, *ignored) if not (ROOT / path).is_file()]
    missing += [glob for glob in globs if not list((ROOT / "tests").rglob(glob))]
    assert not missing, missing

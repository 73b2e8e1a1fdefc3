"""The contract's references resolve inside the repository: every "§N" / "§N.M" in a tracked source or doc
file names a section of docs/SPEC.md, and nothing points at the workspace outside the repository."""
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SPEC = REPO / "docs" / "SPEC.md"
SOURCE_SUFFIXES = {".py", ".h", ".cpp", ".cu", ".cuh", ".md"}

# "§3", "§3.1", and the far end of a range written "§3-5" / "§3-§5" / "§3–5".
SECTION_REF = re.compile(r"§(\d+)(?:\.(\d+))?(?:\s*[-–]\s*§?(\d+)(?:\.(\d+))?)?")
SECTION_HEADING = re.compile(r"^##\s+§(\d+)\s", re.MULTILINE)
SUBSECTION_HEADING = re.compile(r"^###\s+(\d+)\.(\d+)\s", re.MULTILINE)
# Built from pieces so that this file does not match itself.
OUTSIDE_REF = re.compile(re.escape("../" + "shared") + "|" + re.escape("shared" + "/spec"))


def tracked_files() -> list:
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout ({err})")
    return [REPO / name for name in listing.stdout.decode().split("\0") if name]


def text_of(path: pathlib.Path):
    """The file's text, or None for a binary file (or one removed from the working tree)."""
    try:
        with open(path, "rb") as file:
            head = file.read(8192)
            if b"\0" in head:
                return None
            data = head + file.read()
    except FileNotFoundError:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def spec_sections(text: str) -> set:
    """{"1", "1.1", ...}: the sections and numbered subsections that docs/SPEC.md defines."""
    sections = set(SECTION_HEADING.findall(text))
    for major, minor in SUBSECTION_HEADING.findall(text):
        assert major in sections, f"docs/SPEC.md: subsection {major}.{minor} outside a section §{major}"
        sections.add(f"{major}.{minor}")
    return sections


def bad_references(text: str, sections: set) -> list:
    """(line number, reference) for every section reference in text that names no section."""
    bad = []
    for match in SECTION_REF.finditer(text):
        first = match.group(1) + (f".{match.group(2)}" if match.group(2) else "")
        ends = [first]
        if match.group(3):
            ends.append(match.group(3) + (f".{match.group(4)}" if match.group(4) else ""))
        if any(end not in sections for end in ends):
            bad.append((text.count("\n", 0, match.start()) + 1, match.group(0)))
    return bad


def test_spec_has_every_section():
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    assert {str(n) for n in range(1, 11)} <= sections
    assert {"1.1", "1.2", "1.3", "1.4", "3.1", "3.2", "3.3"} <= sections


def test_section_references_resolve():
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    unresolved = []
    for path in tracked_files():
        if path.suffix not in SOURCE_SUFFIXES:
            continue
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(REPO)
        unresolved += [f"{rel}:{line}: {ref}" for line, ref in bad_references(text, sections)]
    assert not unresolved, "references to sections docs/SPEC.md does not have:\n" + "\n".join(unresolved)


def test_no_reference_outside_the_repository():
    outside = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(REPO)
        for match in OUTSIDE_REF.finditer(text):
            outside.append(f"{rel}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
    assert not outside, "point these at docs/SPEC.md (or another file in the repository):\n" + "\n".join(outside)


def test_checker_catches_bad_references():
    # The sign is spelled out so that this file's own examples of bad references are not flagged.
    sign = "\N{SECTION SIGN}"
    sections = {"1", "1.1", "3", "3.1", "5"}
    assert bad_references(f"SPEC {sign}1.1, {sign}3.1 and {sign}3-5; {sign}3-{sign}5", sections) == []
    assert bad_references(f"SPEC {sign}11", sections) == [(1, f"{sign}11")]
    assert bad_references(f"x\n{sign}3.4", sections) == [(2, f"{sign}3.4")]
    assert bad_references(f"{sign}3-7", sections) == [(1, f"{sign}3-7")]


TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_cited_tests_exist():
    """Every `tests/<file>.py::<test>` a doc cites (docs/sampling.md's "Numerics" names the test of each clause)
    is a function of that file."""
    cited = [(doc, m.group(1), m.group(2)) for doc in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
             for m in TEST_REF.finditer(doc.read_text())]
    assert cited
    missing = [f"{doc.name}: {path}::{name}" for doc, path, name in cited
               if not (REPO / path).exists() or f"def {name}(" not in (REPO / path).read_text()]
    assert not missing, missing

"""Every "docs/design/<file>.md §N" reference names a design document and a section it has, and no
reference to a document outside the repository ("spec §N") is left."""
from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design"
# Where the references live: the package, its tests and tools, and the documentation.
SCANNED = [ROOT / "kestrel", ROOT / "tests", ROOT / "scripts", ROOT / "docs", ROOT / "README.md"]
SUFFIXES = {".py", ".md", ".sh", ".toml"}

REFERENCE = re.compile(r"docs/design/([\w.-]+\.md)`?((?:(?:,| and) ?§\d+(?:\.\d+)*| §\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#+ (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
# A section sign that starts no reference of its own: "spec §2", "specs/speculative.md §1".
BARE = re.compile(r"\bspecs?\b[^\n§]{0,20}§|\bspecs/", re.IGNORECASE)


@functools.cache
def sources() -> tuple[Path, ...]:
    files = []
    for place in SCANNED:
        files += [place] if place.is_file() else [p for p in place.rglob("*") if p.suffix in SUFFIXES]
    return tuple(f for f in files if f != Path(__file__).resolve())


@functools.cache
def text(path: Path) -> str:
    return path.read_text(errors="replace")


@functools.cache
def sections(document: Path) -> set[str]:
    return set(HEADING.findall(text(document)))


def references() -> list[tuple[str, str, str]]:
    """(where, file, section) for every section cited by a docs/design reference."""
    found = []
    for path in sources():
        for number, line in enumerate(text(path).splitlines(), 1):
            for match in REFERENCE.finditer(line):
                for section in SECTION.findall(match.group(2)) or [""]:
                    found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), section))
    return found


def test_every_design_reference_names_an_existing_file_and_section():
    refs = references()
    assert any(where.startswith("kestrel/") and section for where, _, section in refs), "no references found"
    bad = []
    for where, name, section in refs:
        document = DESIGN / name
        if not document.is_file():
            bad.append(f"{where}: docs/design/{name} does not exist")
        elif section and section not in sections(document):
            bad.append(f"{where}: docs/design/{name} has no section {section}")
    assert not bad, "\n".join(bad)


def test_no_reference_to_a_document_outside_the_repository():
    bad = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
           for path in sources()
           for number, line in enumerate(text(path).splitlines(), 1)
           if BARE.search(line)]
    assert not bad, "\n".join(bad)


def test_every_section_sign_in_the_package_belongs_to_a_design_reference():
    """In kestrel/ a "§N" always says which document it is in, so a reader can open it."""
    bad = []
    for path in (ROOT / "kestrel").rglob("*.py"):
        for number, line in enumerate(text(path).splitlines(), 1):
            cited = sum(len(SECTION.findall(m.group(2))) for m in REFERENCE.finditer(line))
            if line.count("§") > cited:
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_wrong_section_and_a_bare_reference():
    """The patterns above on made-up lines (so the checks can fail)."""
    doc = DESIGN / "deepseek-v4.md"
    assert "2.5" in sections(doc) and "9" not in sections(doc)
    line = "see docs/design/deepseek-v4.md §2.5 and §9, docs/design/nowhere.md §1"
    assert [(m.group(1), SECTION.findall(m.group(2))) for m in REFERENCE.finditer(line)] == \
        [("deepseek-v4.md", ["2.5", "9"]), ("nowhere.md", ["1"])]
    assert BARE.search("(spec " + "§6)") and BARE.search("(specs/speculative.md)")
    assert not BARE.search("the speculative loop (docs/design/speculative-decoding.md §2)")

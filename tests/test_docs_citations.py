"""Citations of the reference notes in docs/ resolve, and no code cites notes that live outside the repository.

A citation is ``docs/<file>.md`` optionally followed (after closing quotes, spaces, a line break or a comment ``#``)
by sections: numbers (``§1.4``), ranges (``§3.10–3.12``, ``§3.10-§3.11``), lists (``§2.4, §4.3``), or a section
name (``§ Data flow``). Every cited file must exist under docs/ and every cited section must have a heading there:
``## §1.4 ...`` (or ``## 1.4 ...``) for a number, a heading starting with the name for a name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCANNED = ("orttrainer", "tests", "benchmarks", "examples")
THIS = Path(__file__).resolve()

CITATION = re.compile(r"docs/(?P<file>[\w.-]+?\.md)")
NUMBER = r"\d+(?:\.\d+)*"
SECTION = re.compile(rf"§\s*(?P<first>{NUMBER})(?:\s*[–—-]\s*§?\s*(?P<last>{NUMBER}))?")
NAMED = re.compile(r"§\s*(?P<name>[A-Z][A-Za-z-]*(?: [a-z][A-Za-z-]*)*)")
LEAD = re.compile(r"[`'\"]*[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?")  # closing quotes, spaces, one line break, `#`
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t]*$", re.MULTILINE)
HEADING_NUMBER = re.compile(rf"^§?\s*(?P<number>{NUMBER})\.?(?:\s|$)")
OLD_NOTE = re.compile(r"(?<!docs/)\b(?:engine|legacy_api|DESIGN|debug_and_pythonop)\.md")


def python_files() -> list[Path]:
    files = []
    for top in SCANNED:
        files += [p for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts]
    return [p for p in files if p.resolve() != THIS]


def expand(first: str, last: str | None) -> list[str]:
    """`3.10`–`3.12` -> 3.10, 3.11, 3.12; a range that does not share its prefix gives its two ends."""
    if last is None:
        return [first]
    a, b = first.split("."), last.split(".")
    if len(b) < len(a):
        b = a[: len(a) - len(b)] + b
    if a[:-1] == b[:-1] and int(a[-1]) <= int(b[-1]):
        return [".".join([*a[:-1], str(i)]) for i in range(int(a[-1]), int(b[-1]) + 1)]
    return [first, ".".join(b)]


def citations(text: str) -> list[tuple[int, str, list[str], list[str]]]:
    """(line, file, section numbers, section names) for every docs/ citation in `text`."""
    found = []
    for match in CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        start = LEAD.match(text, match.end()).end()
        numbers: list[str] = []
        names: list[str] = []
        if text.startswith("§", start):
            following = CITATION.search(text, start)
            stop = following.start() if following else len(text)
            segment = re.split(r"[)\n;]", text[start:stop], maxsplit=1)[0]
            for section in SECTION.finditer(segment):
                numbers += expand(section["first"], section["last"])
            if not numbers and (named := NAMED.match(segment)):
                names.append(named["name"])
        found.append((line, match["file"], numbers, names))
    return found


def headings(doc: Path) -> tuple[set[str], list[str]]:
    """Section numbers and lower-cased heading texts (without a leading § or number) of a markdown file."""
    numbers, texts = set(), []
    for match in HEADING.finditer(doc.read_text(encoding="utf-8")):
        text = match["text"]
        if number := HEADING_NUMBER.match(text):
            numbers.add(number["number"])
        texts.append(re.sub(rf"^§?\s*(?:{NUMBER}\.?)?\s*", "", text).lower())
    return numbers, texts


def test_parser_reads_the_citation_forms():
    text = (
        "a (docs/legacy_api.md §3.10–3.12, §9) b\n"
        "c docs/engine.md\n    §1.4), d\n"
        "e (docs/debugging.md §1, §2, §4.1-4.3) f docs/legacy_api.md §3.10-§3.11\n"
        "# g (docs/engine.md\n# §2.3) h docs/design.md § Data flow): i\n"
        "j (docs/legacy_api.md §14.4 module functions, §9.5 `x`) k docs/README.md\n"
        "l ``docs/debugging.md`` §2.4; m\n"
    )
    assert citations(text) == [
        (1, "legacy_api.md", ["3.10", "3.11", "3.12", "9"], []),
        (2, "engine.md", ["1.4"], []),
        (4, "debugging.md", ["1", "2", "4.1", "4.2", "4.3"], []),
        (4, "legacy_api.md", ["3.10", "3.11"], []),
        (5, "engine.md", ["2.3"], []),
        (6, "design.md", [], ["Data flow"]),
        (7, "legacy_api.md", ["14.4", "9.5"], []),
        (7, "README.md", [], []),
        (8, "debugging.md", ["2.4"], []),
    ]


def test_docs_citations_resolve():
    problems = []
    for path in python_files():
        for line, name, numbers, names in citations(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(ROOT)}:{line}"
            doc = DOCS / name
            if not doc.is_file():
                problems.append(f"{where}: docs/{name} does not exist")
                continue
            have_numbers, have_texts = headings(doc)
            problems += [f"{where}: docs/{name} has no heading §{n}" for n in numbers if n not in have_numbers]
            problems += [
                f"{where}: docs/{name} has no heading '{n}'"
                for n in names
                if not any(text.startswith(n.lower()) for text in have_texts)
            ]
    assert not problems, "\n".join(problems)


def test_no_citations_of_notes_outside_the_repository():
    stale = []
    for path in python_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            stale += [f"{path.relative_to(ROOT)}:{number}: {m[0]}" for m in OLD_NOTE.finditer(line)]
    assert not stale, "cite docs/<file>.md instead:\n" + "\n".join(stale)


def test_docs_index_lists_every_document():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"

"""Every figure of the README's "Measured" table links to the dated section it comes from
(and every other anchored link of the docs resolves).

A link `docs/X.md#anchor` resolves when X exists and has a heading whose GitHub slug is
`anchor` (lower case; punctuation other than `-` and `_` dropped; spaces to `-`; a repeated
heading gets `-1`, `-2` ...). Renaming a heading in docs/benchmarks.md or docs/routing.md
without its README link fails here.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\((?P<path>[^)#\s]+\.md)#(?P<anchor>[^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The GitHub anchors of a document's headings (fenced code is not a heading)."""
    seen: Counter[str] = Counter()
    found = set()
    outside = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", outside, re.M):
        base = slug(match.group(1))
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def measured_links() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    return [(match["path"], match["anchor"]) for match in LINK.finditer(table)]


def test_every_measured_figure_links_to_an_existing_section():
    links = measured_links()
    assert len(links) >= 9, links
    broken = [f"{path}#{anchor}" for path, anchor in links if anchor not in anchors((ROOT / path).read_text())]
    assert not broken, f"README's Measured table links to sections that do not exist: {broken}"


def test_slugs_follow_github():
    assert slug("Set-up, test suite and CI durations") == "set-up-test-suite-and-ci-durations"
    assert slug("`tiers.cpu`: the arena") == "tierscpu-the-arena"
    assert slug("Measured: a multi-turn trace under three routers") == "measured-a-multi-turn-trace-under-three-routers"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### B (26 Nov)\n") == {"a", "a-1", "b-26-nov"}


def test_a_renamed_heading_breaks_its_link():
    assert "against-the-goals" in anchors((ROOT / "docs" / "benchmarks.md").read_text())
    renamed = (ROOT / "docs" / "benchmarks.md").read_text().replace("### Against the goals", "### Against goals")
    assert "against-the-goals" not in anchors(renamed)


def test_every_anchored_link_in_the_docs_resolves():
    """The same for every `X.md#anchor` and `#anchor` link of README.md, docs/ and the examples."""
    broken = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("**/README.md")]:
        text = doc.read_text()
        targets = [(doc.parent / m["path"], m["anchor"]) for m in LINK.finditer(text)]
        targets += [(doc, anchor) for anchor in re.findall(r"\]\(#([^)\s]+)\)", text)]
        for target, anchor in targets:
            if not target.is_file() or anchor not in anchors(target.read_text()):
                broken.append(f"{doc.relative_to(ROOT)} -> {target.name}#{anchor}")
    assert not broken, broken


def test_the_readme_lists_every_doc_page():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Documentation\n", 1)[1]
    missing = [page.name for page in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{page.name})" not in table]
    assert not missing, f"README's Documentation table leaves out {missing}"

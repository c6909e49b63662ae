"""The README's two set-up commands exist and CI runs exactly the test one; the README and the results summary stay
short enough to take in, each section of the summary links its study's page, and every relative link of the
documents reaches its file and heading (the reference material and the studies moved into docs/ pages)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs/results").glob("*.md"))]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith("python3 -m venv .venv")
    assert f"\n{ci_command}\n" in readme


def test_readme_main_command_installs_with_the_cpu_torch_pin():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e . && .venv/bin/sparserl compare --out runs/default" in readme
    assert (ROOT / "constraints.txt").read_text().strip() == "torch==2.13.0"


def test_the_readme_and_the_results_summary_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len((ROOT / "docs/results.md").read_text().splitlines()) <= 300


def test_each_section_of_the_results_summary_links_a_study_page():
    summary = (ROOT / "docs/results.md").read_text()
    sections = re.split(r"^## ", summary, flags=re.M)[1:]
    assert len(sections) >= 8, "the summary's sections were not found"
    for section in sections:
        title = section.splitlines()[0]
        if title.startswith("Headings corrected"):
            continue  # a list of what changed, not a claim
        pages = re.findall(r"\]\((results/[\w-]+\.md)[)#]", section)
        assert pages, f"docs/results.md, section {title!r}: no link to its study's page under docs/results/"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens, and a
    repeated heading numbered -1, -2, ... (headings inside fenced blocks are not headings)."""
    anchors, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S).splitlines():
        heading = re.match(r"^#{1,6} +(.+?) *$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_follow_githubs_rule():
    text = "# Paper regime (B = 80)\n```bash\n# a comment, not a heading\n```\n## Notes\n## Notes\n### What's `α`?\n"
    assert heading_anchors(text) == {"paper-regime-b--80", "notes", "notes-1", "whats-α"}


def test_every_relative_link_in_the_documents_resolves():
    assert len(DOCUMENTS) >= 10, "the documents were not found"
    broken = []
    for document in DOCUMENTS:
        prose = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            destination = (document.parent / file).resolve() if file else document
            where = f"{document.relative_to(ROOT)}: ({target})"
            if not destination.exists():
                broken.append(f"{where}: no such file")
            elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination.read_text()):
                broken.append(f"{where}: no heading with that anchor in {destination.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)

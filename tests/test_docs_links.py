"""Every relative link in the README and docs/ points to a file that exists and, with a
#fragment, to a heading of that file (GitHub's anchor rules): a moved section breaks this test."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_slug_follows_githubs_rules():
    assert slug("Choosing the trust budget δ") == "choosing-the-trust-budget-δ"
    assert slug("Sandbox experiment: the paper's comparison on a CPU") == "sandbox-experiment-the-papers-comparison-on-a-cpu"
    assert slug("What averaging the LoRA factors costs") == "what-averaging-the-lora-factors-costs"


def test_every_relative_link_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []

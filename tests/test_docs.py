"""The README and docs/ link only files that are in the repository, and code that cites a design document cites
docs/design.md, which is here."""
import re
import subprocess

from tests.conftest import ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_no_file_cites_a_design_document_that_is_not_in_the_repository():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.toml"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    cited = [name for name in tracked if (ROOT / name).exists()
             and re.search(r"(?<![\w/])DESIGN\.md", (ROOT / name).read_text(errors="replace"))]
    assert cited == [], "cite docs/design.md instead"

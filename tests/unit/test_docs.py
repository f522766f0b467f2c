"""The repository's docs stand alone: no link or path in README.md or docs/ leads outside the repository, and
every relative link names a file that exists."""

import os
import re

from fixtures import ROOT

DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_no_doc_points_outside_the_repository():
    outside = []
    for path in DOCS:
        text = open(path).read()
        for number, line in enumerate(text.splitlines(), 1):
            if "../" in line or "shared/SPEC" in line or "SPEC.md" in line or "SPEC-more" in line:
                outside.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()[:100]}")
    assert outside == [], "\n".join(outside)


def test_every_relative_link_exists():
    missing = []
    for path in DOCS:
        for target in LINK.findall(open(path).read()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            file = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not file.startswith(ROOT + os.sep) or not os.path.exists(file):
                missing.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert missing == [], missing

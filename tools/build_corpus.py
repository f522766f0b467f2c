"""Rebuild the embedded corpus data/corpus/python-docs-3.11.jsonl.gz (provenance record; not run at setup).

Source: the reStructuredText sources of the Python 3.11 documentation (tutorial, HOWTOs, FAQ, language
reference, What's New, glossary) as shipped in Debian's python3.11-doc package (html/_sources/*.rst.txt).
Licence: PSF License Agreement, which covers Python "and its associated documentation" and permits
redistribution with the notice kept (data/corpus/LICENSE-PSF.txt).

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb pkg
    python tools/build_corpus.py pkg/usr/share/doc/python3.11/html/_sources data/corpus/python-docs-3.11.jsonl.gz

Markup is reduced to plain text: directive lines, index/label targets and heading underlines are dropped,
inline roles keep their text. One JSON line per document section.
"""

import gzip
import json
import os
import re
import sys

PARTS = ("tutorial", "howto", "faq", "reference", "whatsnew", "glossary.rst.txt")
_ROLE = re.compile(r":[a-z:]+:`(?:[^`<]*<)?~?!?([^`>]*)>?`")
_DIRECTIVE = re.compile(r"^\s*\.\. ")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`])\1{3,}\s*$")


def clean(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if _DIRECTIVE.match(line) or _UNDERLINE.match(line) or line.strip().startswith(":"):
            continue
        line = _ROLE.sub(r"\1", line).replace("``", "").replace("**", "")
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def sections(text: str):
    """Split a cleaned document into sections of at most ~8 KB at paragraph boundaries."""
    chunk = []
    for para in text.split("\n\n"):
        chunk.append(para)
        if sum(len(p) for p in chunk) > 8000:
            yield "\n\n".join(chunk)
            chunk = []
    if chunk:
        yield "\n\n".join(chunk)


def main(src: str, out: str) -> None:
    files = []
    for part in PARTS:
        path = os.path.join(src, part)
        if os.path.isfile(path):
            files.append(path)
        for root, _, names in os.walk(path):
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".rst.txt")]
    n = 0
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        for path in sorted(files):
            with open(path, encoding="utf-8") as g:
                for section in sections(clean(g.read())):
                    if len(section) > 200:
                        f.write(json.dumps({"text": section, "source": os.path.relpath(path, src)}) + "\n")
                        n += 1
    print(f"wrote {n} sections from {len(files)} files to {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

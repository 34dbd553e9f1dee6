"""Replace named sections of a Markdown file, leaving the rest as it was.

A section lives between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`. A section not yet in
the file is added at the end in the order given, so a run of some parts updates only theirs.
"""
from __future__ import annotations

import re
from pathlib import Path


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def update_sections(path: Path, sections: dict[str, str], title: str) -> None:
    text = path.read_text() if path.exists() else f"{title}\n"
    for name, body in sections.items():
        start, end = _markers(name)
        block = f"{start}\n{body.strip()}\n{end}"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

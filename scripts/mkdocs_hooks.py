"""mkdocs hook: replaces each `<!-- gen:NAME -->` in a page with what the code says (scripts/docs_reference.py)
or what the result files say (benchmarks/render.py), so that no reference table or figure is typed by hand,
and adds the benchmarks' plots, drawn from the same result files, to the site. An unknown name fails the build."""
import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "benchmarks")]

import docs_reference  # noqa: E402
import render  # noqa: E402

GENERATORS = {**docs_reference.GENERATORS, **render.GENERATORS}
MARK = "<!-- gen:"


def on_page_markdown(markdown: str, page, config, files) -> str:
    while MARK in markdown:
        start = markdown.index(MARK)
        end = markdown.index("-->", start)
        name = markdown[start + len(MARK):end].strip()
        if name not in GENERATORS:
            raise KeyError(f"{page.file.src_path}: no generator named {name!r}; known: {sorted(GENERATORS)}")
        markdown = markdown[:start] + GENERATORS[name]() + markdown[end + 3:]
    return markdown


def on_files(files, config):
    for path, png in render.plots().items():
        files.append(File.generated(config, path, content=png))
    return files

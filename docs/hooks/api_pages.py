"""MkDocs hook: the API reference pages that the nav of mkdocs.yml names, generated.

A nav entry `api/MODULE.md` becomes a page holding `::: MODULE` (mkdocstrings renders the module's
docstrings), so the nav's "API reference" section is the one list of documented modules: when a
module moves, its line there is the only change.
"""

import re
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

API_FOLDER = "api/"
# The docstrings name objects with Sphinx roles (:class:`Env`), which Markdown leaves as text before the code.
SPHINX_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):(?=<code>)")


def api_pages(nav: Any) -> list[str]:
    """The `api/MODULE.md` paths anywhere in a nav (lists of entries, `{title: entry}` maps, paths)."""
    if isinstance(nav, str):
        return [nav] if nav.startswith(API_FOLDER) and nav.endswith(".md") else []
    if isinstance(nav, dict):
        nav = list(nav.values())
    return [path for entry in nav or [] for path in api_pages(entry)]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds a generated page for each API entry of the nav that no file of docs/ provides."""
    for path in api_pages(config.nav):
        if files.get_file_from_path(path) is None:
            module = path.removeprefix(API_FOLDER).removesuffix(".md")
            files.append(File.generated(config, path, content=f"::: {module}\n"))
    return files


def on_page_content(html: str, page: Page, **kwargs: Any) -> str:
    """Drops the Sphinx role before each name on an API page: `:class:Env` reads `Env`."""
    return SPHINX_ROLE.sub("", html) if page.file.src_uri.startswith(API_FOLDER) else html

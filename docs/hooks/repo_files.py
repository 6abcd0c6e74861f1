"""MkDocs hook (mkdocs.yml ``hooks:``): links from the docs to files outside docs/.

The pages link to result files, plots and sources the way GitHub reads them: relative to
the page, e.g. ``../../benchmarks/results/dct_cpu_2026-11-22.png`` from
``docs/methods/``.  MkDocs only knows the files under ``docs/``, so this hook copies every
repository file such a link names into the site under ``_repo/`` and points the link
there; images render, result files download, and ``mkdocs build --strict`` still fails on
a link to a file that does not exist.  Links to a folder, or to a Markdown file outside
docs/, are left alone (MkDocs then reports them): write those as code spans.

It also tidies two reStructuredText habits of the docstrings for the API reference
pages: Sphinx roles (``:class:`~a.b.C``` is rendered by mkdocstrings as
``:class:<code>~a.b.C</code>`` and is shown as ``<code>C</code>``; ``~``: the last name;
``.x``: as written, without the dot), and simple tables (``=====  =====`` rules), which
Markdown runs together into one paragraph: they are shown preformatted.
"""
import os
import posixpath
import re

from mkdocs.structure.files import File

LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj):<code>(~?)\.?([^<]*)</code>")
RST_TABLE = re.compile(r"<p>(={3,}[ =]*\n.*?\n={3,}[ =]*)</p>", re.S)
PREFIX = "_repo"


def _outside_target(url, page_src_uri, docs_dir, root):
    """The repository path (posix) of a relative link that leaves docs/, else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith(("/", "#")):
        return None
    path = url.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    here = os.path.dirname(os.path.join(docs_dir, page_src_uri))
    target = os.path.normpath(os.path.join(here, path))
    if not os.path.relpath(target, docs_dir).startswith(".."):
        return None                       # a docs page or asset: MkDocs' own business
    rel = os.path.relpath(target, root)
    if rel.startswith("..") or not os.path.isfile(target) or target.endswith(".md"):
        return None
    return rel.replace(os.sep, "/")


def _links(markdown):
    return [m.group(2) for m in LINK.finditer(markdown)]


def on_files(files, config):
    docs_dir = config["docs_dir"]
    root = os.path.dirname(config["config_file_path"])
    wanted = set()
    for f in files.documentation_pages():
        with open(f.abs_src_path, encoding="utf-8") as fh:
            text = fh.read()
        for url in _links(text):
            rel = _outside_target(url, f.src_uri, docs_dir, root)
            if rel:
                wanted.add(rel)
    for rel in sorted(wanted):
        files.append(File.generated(config, f"{PREFIX}/{rel}",
                                    abs_src_path=os.path.join(root, rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = config["docs_dir"]
    root = os.path.dirname(config["config_file_path"])

    def rewrite(m):
        url = m.group(2)
        rel = _outside_target(url, page.file.src_uri, docs_dir, root)
        if rel is None:
            return m.group(0)
        anchor = url[len(url.split("#", 1)[0]):]
        new = posixpath.relpath(f"{PREFIX}/{rel}", posixpath.dirname(page.file.src_uri) or ".")
        return m.group(1) + new + anchor + m.group(3)

    return LINK.sub(rewrite, markdown)


def on_page_content(html, page, config, files):
    def role(m):
        name = m.group(2)
        return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"

    return RST_TABLE.sub(r"<pre>\1</pre>", ROLE.sub(role, html))

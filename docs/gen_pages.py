"""Run by the site build (mkdocs-gen-files): adds the pages generated from the code and fills the
generated blocks of hand-written pages (see testbed/docsite/pages.py)."""

import mkdocs_gen_files

from testbed.docsite.pages import fill, generate, pages_with_blocks

for path, text in generate().items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(text)

for path in pages_with_blocks():
    with mkdocs_gen_files.open(path, "r") as f:
        text = f.read()
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(fill(text, path))

"""The documentation site's generated parts: reference pages read from the code (the CLI's
parsers, the scenario models, the run-directory artefacts, the router's routes, the backend
registry) and the registry of measurements the docs quote (`make docs-results`).

It sits above `cli` in the layer order: it reads every layer and nothing imports it.
`docs/gen_pages.py` hands `pages.generate()` to the site build (mkdocs-gen-files).
"""

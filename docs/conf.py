"""Sphinx configuration of ckptd's documentation (``make docs``: warnings are errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "ckptd"
author = "the ckptd developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "bench"]
myst_heading_anchors = 4  # GitHub's slugs for headings, so page#section links work as they did in README
myst_enable_extensions = ["colon_fence"]
suppress_warnings = ["myst.header"]  # pages moved from README keep their heading levels
html_theme = "furo"
html_title = "ckptd"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

"""Sphinx with MyST Markdown: the docs site (issue 49).

Why Sphinx and MyST: Sphinx is what PyTorch, DeepSpeed, NVIDIA's resiliency extension and most of this field's
libraries document themselves with, so a user meets a familiar site; MyST lets every page stay Markdown (the
README's dialect, readable on GitHub as it is) while Sphinx checks every cross-reference: built with ``-W``
(warnings as errors) and ``-n`` (nitpicky), a broken link or a page missing from the tree fails CI.
"""

project = "distdebug"
author = "the distdebug developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "README.md"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
highlight_language = "none"
# No smart quotes: Sphinx would turn the "--" of an option written in prose into an en dash and straight quotes
# into curly ones, and a command pasted from the page would fail (docs/check_built.py holds it on the built site)
smartquotes = False
nitpicky = True
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = "distdebug"

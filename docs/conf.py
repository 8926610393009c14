"""Sphinx configuration of jlms's documentation.

    pip install -e ".[docs]" && python -m sphinx -W --keep-going -b html docs docs/_build/html

Why Sphinx with MyST and myst-nb: it is what JAX, Flax and optax build
their documentation with, so a JAX user finds the same layout, and one
tool covers the three things this site needs: pages in Markdown (MyST),
the memory-report notebook rendered with the outputs stored in it (myst-nb,
with execution off: the docs build runs no model and compiles nothing), and
an API reference from the docstrings (autodoc, with napoleon for their
Google-style "Args:/Returns:" sections). The theme is furo: plain, readable,
and maintained.

autodoc imports jlms, which imports jax; JAX_PLATFORMS=cpu keeps that from
looking for a GPU, so the site builds on any machine.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jlms, installed or not

import jlms  # noqa: E402

project = "jlms"
author = "the jlms authors"
copyright = "the jlms authors"
release = jlms.__version__
version = release

extensions = [
    "myst_nb",  # Markdown pages (it brings myst_parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb",
                 ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "jupyter_execute", "figures.py"]

# Notebooks are shown as they were saved, outputs included: never run here.
nb_execution_mode = "off"
# Markdown outputs (the notebook displays a table) as GitHub-flavoured.
nb_render_markdown_format = "gfm"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# In docstrings `name` is code, as in the Markdown pages.
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"jlms {release}"
html_static_path = ["_static"]

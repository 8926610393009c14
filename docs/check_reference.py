"""Fails when an entry of the built API reference has no text of its own.

    python docs/check_reference.py docs/_build/html/api.html

autodoc lists a dataclass field, an enum member or a property with
`:undoc-members:` even where it has no docstring; such an entry shows
its name alone. This reads the built page and names every entry (a `dt`
of Sphinx's Python domain) whose `dd` has no text outside the entries
nested in it (a class's members are its own entries). Documented fields
carry a `#:` comment above them.
"""

import html.parser
import pathlib
import sys

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link",
         "meta", "source", "track", "wbr"}


class _Entries(html.parser.HTMLParser):
  """Each entry's id -> the text of its `dd`, nested entries left out."""

  def __init__(self):
    super().__init__()
    self.text: dict[str, str] = {}
    self._signature = None  # id of the open `dt`
    self._awaiting = None  # id of the closed `dt` whose `dd` comes next
    self._open: list[tuple[str, str | None]] = []  # (tag, entry it opens)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    entry = None
    if tag == "dt" and "sig-object" in (attrs.get("class") or "").split():
      self._signature = attrs.get("id") or f"<unnamed {len(self.text)}>"
    elif tag == "dd" and self._awaiting is not None:
      entry, self._awaiting = self._awaiting, None
      self.text[entry] = ""
    if tag not in _VOID:
      self._open.append((tag, entry))

  def handle_endtag(self, tag):
    while self._open and self._open.pop()[0] != tag:
      pass
    if tag == "dt" and self._signature is not None:
      self._awaiting, self._signature = self._signature, None

  def handle_data(self, data):
    for tag, entry in reversed(self._open):  # the innermost open entry's
      if tag == "dt":  # a signature, a nested entry's included
        return
      if entry is not None:
        self.text[entry] += data
        return


def entries(page: str) -> dict[str, str]:
  """Each entry's id (`jlms.Plan.fitted`) -> its own text."""
  parser = _Entries()
  parser.feed(page)
  parser.close()
  return parser.text


def empty_entries(page: str) -> list[str]:
  """The ids of the entries of `page` with no text of their own."""
  return [name for name, text in entries(page).items() if not text.strip()]


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  page = pathlib.Path(argv[0]).read_text(encoding="utf-8")
  found, empty = entries(page), empty_entries(page)
  if not found:
    print(f"{argv[0]}: no API entries found", file=sys.stderr)
    return 1
  for name in empty:
    print(f"{argv[0]}: {name} has no docstring", file=sys.stderr)
  print(f"{len(found)} API entries, {len(empty)} empty")
  return 1 if empty else 0


if __name__ == "__main__":
  sys.exit(main())

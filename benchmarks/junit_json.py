"""A pytest run's JUnit XML files as one JSON record: per tier, the counts
and each test's outcome, seconds and first 300 characters of its message.
`benchmarks/gpu_session.sh` keeps its GPU test runs this way, beside the
benchmarks' figures.

    python -m benchmarks.junit_json TIER=RESULT.xml [TIER=RESULT.xml ...] --json PATH
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree

from benchmarks._output import write_json

_COUNTS = ("tests", "failures", "errors", "skipped", "time")


def tier(path: str) -> dict:
  """Counts and cases of one JUnit XML file."""
  root = ElementTree.parse(path).getroot()
  suite = root.find("testsuite") if root.tag == "testsuites" else root
  cases = []
  for case in suite.iter("testcase"):
    outcome, message = "passed", None
    for tag in ("failure", "error", "skipped"):
      element = case.find(tag)
      if element is not None:
        outcome, message = tag, (element.get("message") or "")[:300]
        break
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                  "outcome": outcome, "seconds": float(case.get("time", 0)),
                  "message": message})
  counts = {key: suite.get(key) for key in _COUNTS}
  return {**counts, "cases": cases}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("tiers", nargs="+", metavar="TIER=RESULT.xml")
  parser.add_argument("--json", required=True)
  parser.add_argument("--note", default=None,
                      help="where and how the tests ran, kept in the record")
  options = parser.parse_args(argv)
  result = {"note": options.note, "tiers": {}}
  for item in options.tiers:
    name, _, path = item.partition("=")
    result["tiers"][name] = tier(path)
    counts = result["tiers"][name]
    print(f"{name}: {counts['tests']} tests, {counts['failures']} failed, "
          f"{counts['errors']} errors, {counts['skipped']} skipped, "
          f"{counts['time']} s")
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()

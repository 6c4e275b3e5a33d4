"""`make test`'s split over two processes loses no test: every test marked child_processes (run
beside the main suite, in the multi-device process) lives in a file that process is given."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_child_process_tests_are_in_the_side_files():
  side = re.search(r"^SIDE_FILES := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
  assert side[0] == "tests/test_multidevice_sharding.py"  # sets the device count before any backend starts
  marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
            if re.search(r"^@pytest\.mark\.child_processes$", p.read_text(), re.M)}
  assert marked and marked <= set(side), sorted(marked - set(side))

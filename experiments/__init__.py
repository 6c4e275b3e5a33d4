"""absl entry points (one module each) and what they share."""

import json
from typing import Any


def write_json(path: str, report: Any, **dump_kwargs) -> None:
  """An entry point's --output: `report` as JSON (indent 1) at `path`; nothing when path is empty."""
  if path:
    with open(path, "w") as f:
      json.dump(report, f, indent=1, **dump_kwargs)

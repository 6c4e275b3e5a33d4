"""The exploration notebook runs top to bottom on the CPU, so it never goes stale."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "notebooks" / "explore.ipynb"


@pytest.mark.side_lane  # about 30 s in its own kernel process: beside the multi-device tests (Makefile)
def test_explore_notebook_executes(monkeypatch):
  monkeypatch.setenv("GLMJAX_NOTEBOOK_CONFIG", "tiny")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "adjacent full-layer overlap" in outputs and "round 2" in outputs

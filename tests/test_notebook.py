"""The walkthrough notebook runs top to bottom, as a learner runs it, without an error."""

from __future__ import annotations

import time

import nbformat
import pytest
from conftest import REPO, child_env
from nbclient import NotebookClient

NOTEBOOK = REPO / "ddp_walkthrough.ipynb"


def test_the_notebook_carries_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(
        not cell.get("outputs") and not cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code"
    )


@pytest.mark.timeout(600)
def test_the_walkthrough_notebook_executes_top_to_bottom(monkeypatch):
    for name, value in child_env().items():  # the kernel and the ranks it starts: no launcher variables
        monkeypatch.setenv(name, value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    started = time.perf_counter()
    # Any cell that raises fails the test with that cell's traceback (CellExecutionError).
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    print(f"notebook executed in {time.perf_counter() - started:.0f} s")
    images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the timeline and the loss curve
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    for seen in ("epoch 0 shard", "cosine(local, averaged)", "hidden behind backward", "[sample]"):
        assert seen in text, seen

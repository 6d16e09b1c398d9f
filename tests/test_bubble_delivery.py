"""The bubble benchmark's delivery term (``benchmarks/pipeline_bubble.py``,
``censored_mean``): the mean delivery over every message of a step, where a message whose wait
did not block is seen only as a bound. Worked by hand; single process, no communication."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bubble():  # noqa: ANN201
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "pipeline_bubble", ROOT / "benchmarks" / "pipeline_bubble.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unseen_deliveries_are_the_mean_capped_by_their_bound(bubble) -> None:  # noqa: ANN001
    """Seen: 2 ms. Unseen, done by 0.5 ms and by 10 ms: L = (2 + min(L, 0.5) + min(L, 10)) / 3
    -> with 0.5 < L < 10, 3 L = 2.5 + L, L = 1.25 (the blocked mean, 2, over-states it)."""
    seen = {("F", 0, 1): 2e-3}
    bounds = {("F", 1, 1): 0.5e-3, ("F", 2, 1): 10e-3, ("F", 0, 1): 0.1e-3}
    assert bubble.censored_mean(seen, bounds) == pytest.approx(1.25e-3, rel=1e-9)
    # a bound above every delivery leaves the seen mean; no message seen: no delivery term
    assert bubble.censored_mean(seen, {("B", 0, 0): 1.0}) == pytest.approx(2e-3)
    assert bubble.censored_mean({("F", 0, 1): 1e-3, ("F", 1, 1): 3e-3}, {}) == \
        pytest.approx(2e-3)
    assert bubble.censored_mean({}, bounds) == 0.0
    # a wait that ended inside the later side's posting call: delivered at once, not before
    assert bubble.censored_mean({("F", 0, 1): -1e-3, ("F", 1, 1): 3e-3}, {}) == \
        pytest.approx(1.5e-3)
    # every unseen message done at once (bound 0): the seen total spread over all of them
    assert bubble.censored_mean(seen, {("F", 1, 1): 0.0, ("F", 2, 1): -1e-6}) == \
        pytest.approx(2e-3 / 3)

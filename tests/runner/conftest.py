"""Fixtures of the runner tests."""

from __future__ import annotations

import pytest

from unified_attn.runner import overlap
from unified_attn.runner.model_runner import ModelRunner


@pytest.fixture
def spy(monkeypatch):
    """Counts overlapped launches as rank 0 makes them (tensor-parallel ranks other than 0 pass
    `to_host=False` and are not counted), and steps fed a token from the device (on every
    runner of this process)."""
    counts = {"launch": 0, "from_device": 0}
    launch, gather = ModelRunner.launch, overlap.DeviceTokens.gather

    def counting_launch(self, output, *args, **kwargs):
        counts["launch"] += bool(output.scheduled) and not args and not kwargs
        return launch(self, output, *args, **kwargs)

    def counting_gather(self, request_ids):
        counts["from_device"] += 1
        return gather(self, request_ids)

    monkeypatch.setattr(ModelRunner, "launch", counting_launch)
    monkeypatch.setattr(overlap.DeviceTokens, "gather", counting_gather)
    return counts

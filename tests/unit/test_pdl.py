"""kestrel/pdl.py off the GPU: nothing takes part, and a launch gets PDL=False and no launch flag."""
from __future__ import annotations

import torch

from kestrel import pdl


def test_off_on_the_cpu():
    assert not pdl.on(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


def test_enabled_false_turns_it_off_everywhere(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.setattr(pdl.envs, "triton_interpret", lambda: False)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}

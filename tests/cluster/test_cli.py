"""The ``baton`` CLI's own behaviour: typed errors become one clean line and exit status 2."""

from __future__ import annotations

import pytest
import torch
from baton_serve.cluster import cli


def test_a_setting_out_of_range_is_one_line_and_status_2(capsys):
    assert cli.main(["serve", "--device", "gpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error:") and "device must be" in err and "Traceback" not in err


def test_a_device_that_is_not_there_is_one_line_and_status_2(capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main(["generate", "--device", "cuda", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: engine.device = 'cuda'") and "Traceback" not in err

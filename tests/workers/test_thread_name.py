"""OS thread names: set for the calling thread only, cut to Linux's 15 bytes."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from baton_serve.workers.thread_name import name_this_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_the_calling_thread_gets_the_name_and_no_other() -> None:
    seen: dict[str, str] = {}

    def named() -> None:
        name_this_thread("baton-engine-and-more")
        seen["tid"] = str(threading.get_native_id())
        seen["comm"] = Path(f"/proc/self/task/{seen['tid']}/comm").read_text().strip()

    main_before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert seen["comm"] == "baton-engine-an"  # 15 bytes
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == main_before

"""`freeze_gc`: what exists when a serving loop starts leaves the cyclic collector's generations
(a full collection would walk it all mid-serving); what comes later is still collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc
    from minisgl.runtime.child import freeze_gc

    before = [[] for _ in range(1000)]  # start-up's objects
    freeze_gc()
    tracked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() >= 1000
    assert not any(id(o) in tracked for o in before), "start-up objects still collected"
    later = []
    later.append(later)  # a cycle made while serving
    assert any(o is later for o in gc.get_objects())
    ref = id(later)
    del later
    assert gc.collect() >= 1 and ref not in {id(o) for o in gc.get_objects()}
    print("ok")
    """
)


def test_start_up_objects_leave_the_collector_and_later_cycles_are_still_collected() -> None:
    # A process of its own: freezing the test runner's heap would outlive this test.
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

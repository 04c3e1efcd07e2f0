"""Hypothesis profiles: the same code gets the same verdict on every run.

    ci      (the default)  derandomized, no example database: the cases a test draws depend only
                           on the test, never on an earlier run's .hypothesis folder or the clock
    grade   (labs grading) ci without shrinking, stopping at the first failure: a failing lab
                           reports its first failing case at once instead of re-running it (and
                           a comm timeout) many times, or looking for a second bug

MINIDIST_HYPOTHESIS=grade picks the second (`tools/labs.py grade` sets it). A test's own
`@settings(max_examples=..., deadline=None)` keeps the profile's other choices: settings inherit
from the profile loaded when the test module is imported, and this file is loaded first.

And the suite leaves nothing behind: its temporary files go to a folder of its own (TMPDIR for
every process it starts, tempfile's folder in this one), which must be empty at the end, once
the pools of ranks the process tier ran on have ended (minidist/launch/pool.py); no other
process on the machine writes there, so the check is exact.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import Phase, settings

from minidist.launch import processes

settings.register_profile("ci", derandomize=True, database=None, print_blob=False)
settings.register_profile(
    "grade",
    settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
)
settings.load_profile(os.environ.get("MINIDIST_HYPOTHESIS", "ci"))


# what torch keeps on purpose, here removed with the folder: its compiled-kernel cache, and the
# log folder torchrun's agent makes for each job (tests/test_launchers.py runs torchrun)
TORCH_CACHES = ("torchinductor_", "torchelastic_")
SUITE_STALE = 600.0  # seconds


@pytest.fixture(scope="session", autouse=True)
def suite_temporary_folder(tmp_path_factory):
    """The suite's own temporary folder; at the end, every entry a test, a launcher or a tool
    left there is an error naming it (and the folder goes). Locked while the run lives, as a
    launcher's folder is: a run killed before its end leaves it to a later run, which removes it
    (once nothing has changed in it for SUITE_STALE seconds: runs from before the lock had none)."""
    tmp_path_factory.getbasetemp()  # pytest's tmp_path folders: where they were, pytest's
    folder, lock = processes.job_folder(prefix="minidist-suite-", min_age=SUITE_STALE)
    names = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT")
    old = {name: os.environ.get(name) for name in names} | {"tempdir": tempfile.tempdir}
    # a pytest run inside this one (grading a lab) keeps its tmp_path folders where ours are
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    yield folder
    from minidist.testing import POOLS  # here: its settings inherit the profile loaded above

    POOLS.close()  # the process tier's ranks end, and their folders go
    for name in names:
        if old[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old[name]
    tempfile.tempdir = old["tempdir"]
    left = sorted(x for x in os.listdir(folder) if not x.startswith(TORCH_CACHES))
    processes.release_folder(folder, lock)
    assert not left, f"the suite left {len(left)} entries in its temporary folder: {left[:20]}"

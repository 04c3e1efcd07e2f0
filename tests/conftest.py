"""Hypothesis profiles: the same code gets the same verdict on every run.

    ci      (the default)  derandomized, no example database: the cases a test draws depend only
                           on the test, never on an earlier run's .hypothesis folder or the clock
    grade   (labs grading) ci without shrinking: a failing lab reports its first failing case
                           at once instead of re-running it (and a comm timeout) many times

MINIDIST_HYPOTHESIS=grade picks the second (`tools/labs.py grade` sets it). A test's own
`@settings(max_examples=..., deadline=None)` keeps the profile's other choices: settings inherit
from the profile loaded when the test module is imported, and this file is loaded first.
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=False)
settings.register_profile(
    "grade", settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate]
)
settings.load_profile(os.environ.get("MINIDIST_HYPOTHESIS", "ci"))

"""The conformance report: a table per capability on the terminal, and the same results as JSON
(--json FILE) and as JUnit XML (--junit FILE, for CI systems: one testcase per check and
backend, a failure or a skip inside it).

    tp  (threads)                              result  examples  seconds
      column_parallel_linear                       ok         6     0.21
      row_parallel_linear                      FAILED         4     0.12
      ...
      4 passed, 1 failed, 0 skipped, 0.9 s
      FAILED tp.row_parallel_linear threads p=4 i=13 o=17 b=7 t=3 layer=row ... seed=32:
      rank 0 y: max |difference| 8.46 (rtol=1e-12, atol=1e-13)      (one line)
"""

from __future__ import annotations

import json
from xml.etree import ElementTree as ET

from minidist.conform.runner import Result

MARK = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}


def example_words(r: Result) -> str:
    """'p=3 shape=(5, 3) dtype=torch.float32 seed=1' of a failing case ('' if none)."""
    if r.world_size is None:
        return ""
    pairs = [f"p={r.world_size}"] + [f"{k}={v}" for k, v in (r.example or {}).items()]
    return " ".join(pairs)


def failure_line(r: Result) -> str:
    """One line: the check, the backend, the world size, the example, the problem (which names
    the tensor, the rank and the largest difference)."""
    where = " ".join(x for x in (r.full_name, r.backend, example_words(r)) if x)
    return f"FAILED {where}: {r.problem}"


def table(results: list[Result]) -> str:
    """A table per capability and backend: a row per check, totals, then the failures."""
    lines = []
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.capability, r.backend), []).append(r)
    for (capability, backend), rows in groups.items():
        if all(r.status == "skipped" and r.problem.startswith("the adapter has no") for r in rows):
            lacks = sorted({r.problem.removeprefix("the adapter has no ") for r in rows})
            lines += [f"{capability}  ({backend}): {len(rows)} skipped, no {', '.join(lacks)}", ""]
            continue
        width = max(len(r.check) for r in rows) + 2
        title = f"{capability}  ({backend})"
        lines.append(f"{title:{width + 2}} {'result':>8} {'examples':>9} {'seconds':>8}")
        for r in rows:
            lines.append(
                f"  {r.check:{width}} {MARK[r.status]:>8} {r.examples:9d} {r.seconds:8.2f}"
            )
        counts = {s: sum(r.status == s for r in rows) for s in MARK}
        seconds = sum(r.seconds for r in rows)
        summary = (
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
        )
        lines.append(f"  {summary}, {seconds:.1f} s")
        for r in rows:
            if r.status == "failed":
                lines.append("  " + failure_line(r))
        skipped = sorted({r.problem for r in rows if r.status == "skipped"})
        lines += [f"  skipped: {why}" for why in skipped]
        lines.append("")
    return "\n".join(lines)


def summary(results: list[Result]) -> dict:
    return {s: sum(r.status == s for r in results) for s in MARK} | {
        "seconds": round(sum(r.seconds for r in results), 3)
    }


def as_json(adapter: str, results: list[Result]) -> dict:
    """The whole report as one object: the adapter, a row per check and backend, the totals."""
    rows = []
    for r in results:
        rows.append(
            {
                "capability": r.capability,
                "check": r.check,
                "backend": r.backend,
                "status": r.status,
                "examples": r.examples,
                "seconds": round(r.seconds, 3),
                "about": r.about,
                "world_size": r.world_size,
                "example": {k: str(v) for k, v in r.example.items()} if r.example else None,
                "problem": r.problem,
                "max_difference": r.max_difference,
                "detail": r.detail,
            }
        )
    return {"adapter": adapter, "results": rows, "summary": summary(results)}


def as_junit(adapter: str, results: list[Result]) -> str:
    """JUnit XML: a testsuite per capability, a testcase per check and backend."""
    root = ET.Element("testsuites", name=f"minidist conform {adapter}")
    suites: dict[str, ET.Element] = {}
    for r in results:
        if r.capability not in suites:
            suites[r.capability] = ET.SubElement(root, "testsuite", name=r.capability)
        case = ET.SubElement(
            suites[r.capability],
            "testcase",
            classname=f"conform.{r.capability}",
            name=f"{r.check}[{r.backend}]",
            time=f"{r.seconds:.3f}",
        )
        if r.status == "failed":
            failure = ET.SubElement(case, "failure", message=failure_line(r))
            failure.text = r.detail
        elif r.status == "skipped":
            ET.SubElement(case, "skipped", message=r.problem)
    for name, suite in suites.items():
        rows = [r for r in results if r.capability == name]
        suite.set("tests", str(len(rows)))
        suite.set("failures", str(sum(r.status == "failed" for r in rows)))
        suite.set("skipped", str(sum(r.status == "skipped" for r in rows)))
        suite.set("errors", "0")
        suite.set("time", f"{sum(r.seconds for r in rows):.3f}")
    return ET.tostring(root, encoding="unicode")


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def save(adapter: str, results: list[Result], json_path=None, junit_path=None) -> None:
    """Write the JSON and JUnit reports where asked."""
    if json_path:
        write(json_path, json.dumps(as_json(adapter, results), indent=2) + "\n")
    if junit_path:
        write(junit_path, as_junit(adapter, results) + "\n")

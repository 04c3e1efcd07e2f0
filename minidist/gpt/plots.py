"""The pictures of `minidist train`: the loss curve (beside one process's with --check), the
pipeline's measured timeline, and the trace of every operation (open in ui.perfetto.dev).
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

from minidist.comm.wrappers import write_chrome_trace
from minidist.pipeline.draw import draw_timeline


def draw(files: dict, config, result: dict, reference: dict | None, report: dict) -> None:
    """files["loss"], files["pipeline"] (pp > 1) and files["trace"], from the run's result,
    the reference's (or None) and report.gather's timeline and events."""
    draw_losses(files["loss"], result, reference)
    if config.pp > 1:
        title = f"{config.schedule}: measured, last step (pp={config.pp}, m={config.microbatches})"
        draw_timeline(report["timeline"], files["pipeline"], title)
    write_chrome_trace(files["trace"], report["events"])


def draw_losses(path: str, result: dict, reference: dict | None) -> None:
    from matplotlib.figure import Figure  # not pyplot: no global state, no GUI backend

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    first = result["first_step"]
    steps = range(first, first + len(result["losses"]))
    ax.plot(steps, result["losses"], label="dp x pp x tp")
    if reference is not None:
        ax.plot(steps, reference["losses"][first : first + len(steps)], "--", label="one process")
    ax.set(xlabel="step", ylabel="loss (whole batch)", title="training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)

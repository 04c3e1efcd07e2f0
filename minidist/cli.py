"""The `minidist` command: `minidist run`, `minidist bench`, ...

minidist train --dp 2 --pp 2 --tp 2 --check          the main job: a small GPT, 8 ranks
minidist sample --resume ckpt                          text from a trained model, any layout's
minidist run -n 4 --backend mpi script.py args...      start 4 ranks on this machine
minidist bench allreduce|p2p -n 2 --backend mpi        nccl-tests style tables
minidist bench dp|tp|pipeline|zero|sgd|batch|moe|cp ...   the techniques, measured
minidist schedule --schedule 1f1b --stages 4 --microbatches 8   a pipeline schedule, drawn
minidist plan --model gpt3-175b --cluster dgx-a100 --gpus 1024   layouts, time, energy, cost
minidist conform my_adapter.py --only collectives,dp   your own code, judged by minidist's tests
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def default_note(action: argparse.Action) -> str:
    """'(default: 8)' for an option with a default worth saying; '' for None, a switch that is
    off, a positional argument."""
    default = action.default
    if not action.option_strings or default is None or default is False:
        return ""
    if default == argparse.SUPPRESS:
        return ""
    shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
    return f"(default: {shown})"


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every option's default after its help text, as `(default: 8)`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        note = default_note(action)
        if not note or "(default" in text:
            return text
        return f"{text} {note.replace('%', '%%')}"


class Parser(argparse.ArgumentParser):
    """The `minidist` parser: its subcommands are built from the same class (argparse's
    default), so each of them shows its defaults in --help, those without help text too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.help is None and default_note(action):
            action.help = default_note(action).replace("%", "%%")  # argparse shows no empty help
        return action


# numeric flags that may be 0 (every other integer flag counts something: at least 1)
MAY_BE_ZERO = set(
    "warmup save_every stop_at seed zero staleness delay spike chance compute target "
    "weight_decay experts temperature".split()
)


def numeric_problems(args: argparse.Namespace) -> list[str]:
    """Every numeric flag out of range, one line each, with its value: integers (and lists of
    them) at least 1, or 0 where MAY_BE_ZERO allows; floats finite and positive (or >= 0)."""
    found = []
    for key, value in vars(args).items():
        low = 0 if key in MAY_BE_ZERO else 1
        flag = ("-" if len(key) == 1 else "--") + key.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if isinstance(v, float) and not (math.isfinite(v) and v >= 0 and (v > 0 or low == 0)):
                found.append(f"{flag} {v}: must be a finite number {'>= 0' if low == 0 else '> 0'}")
            elif isinstance(v, int) and v < low:
                found.append(f"{flag} {v}: must be at least {low}")
    return found


# The most ranks a command starts on this machine. A process rank is a Python with torch
# (measured: 230 MiB resident, mpi and gloo alike) that polls while it waits; past 4 per core
# they mostly wait for a core, and a rank merely descheduled can reach its timeout. Thread-ranks
# share one process and one lock: a barrier of 256 of them took 1.2 s, of 1024 137 s (each
# collective copies and folds every rank's row: work grows with the square of the ranks).
PROCESSES_PER_CORE = 4
THREAD_RANKS = 256


def most_ranks(backend: str) -> tuple[int, str]:
    """(the most ranks `backend` may start here, why in a few words)."""
    if backend == "threads":
        return THREAD_RANKS, "threads of one process, whose collectives cost p^2"
    if backend == "nccl":
        import torch

        return torch.cuda.device_count(), "one rank per GPU, and torch sees that many"
    cores = os.cpu_count() or 1
    return PROCESSES_PER_CORE * cores, f"{PROCESSES_PER_CORE} processes per core, {cores} cores"


def world_problems(flag: str, n: int, backend: str) -> list[str]:
    """['-n 100000: ...'] if n ranks are more than this machine can run on backend, else []."""
    most, why = most_ranks(backend)
    if n <= most or (backend == "nccl" and most == 0):  # no GPU at all: said once, above
        return []
    return [f"{flag} {n}: {backend} runs at most {most} ranks on this machine ({why})"]


def command_problems(args: argparse.Namespace) -> list[str]:
    """What else makes this command unable to start: files, folders, world sizes this machine
    cannot run, flags that do not go together (train: gpt.cli.problems; bench: each
    benchmark's own problems(), once every number is in range)."""
    found = []
    if args.command == "run":
        if not os.path.isfile(args.script):
            found.append(f"{args.script}: no such script")
    if getattr(args, "backend", None) == "nccl":
        import torch  # only here: importing it costs the other commands a second

        if not torch.cuda.is_available():
            found.append("--backend nccl needs a CUDA GPU, and torch sees none: use gloo or mpi")
    if args.command in ("run", "bench"):
        for n in args.n if isinstance(args.n, list) else [args.n]:  # bench zero: several
            found += world_problems("-n", n, args.backend)
    if args.command == "train" and not numeric_problems(args):
        world = args.dp * args.pp * args.tp * args.cp  # ep is carved out of dp
        found += world_problems("--dp x --pp x --tp x --cp", world, args.backend)
    if args.command == "bench" and not found and not numeric_problems(args):  # moe divides by n
        found += _benches()[args.what].problems(args)
    if args.command == "schedule":
        if args.chunks is not None and args.schedule != "interleaved":
            found.append(
                f"--chunks {args.chunks} needs --schedule interleaved (not {args.schedule})"
            )
        folder = os.path.dirname(os.path.abspath(args.png)) if args.png else "."
        if not os.path.isdir(folder):
            found.append(f"--png {args.png}: no folder {folder}")
    return found


def __getattr__(name: str):
    """launch and run_threads, the launcher's, imported when first asked for: only `minidist
    run` starts ranks, and the launcher imports torch, which `minidist plan` never needs."""
    if name in ("launch", "run_threads"):
        from minidist.launch import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'minidist.cli' has no attribute {name!r}")


def _run(args: argparse.Namespace) -> int:
    from minidist.launch import launcher
    from minidist.launch.watchdog import job_timeout

    argv = [args.script, *args.args]
    if args.backend == "threads":
        outcome = launcher.run_threads(argv, args.n, job_timeout(), sends=args.sends)
    else:
        outcome = launcher.launch(argv, args.n, args.backend)
    if outcome.returncode != 0:
        print(f"minidist run: {outcome.report()}", file=sys.stderr, end="")
    return outcome.returncode


def _add_run(sub) -> None:
    from minidist.launch.launcher import BACKENDS

    p = sub.add_parser("run", help="start N ranks of a script on this machine")
    p.add_argument("-n", type=int, required=True, help="number of ranks")
    p.add_argument("--backend", choices=BACKENDS, default="mpi")
    p.add_argument(
        "--sends",
        choices=("buffered", "rendezvous"),
        default="buffered",
        help="threads: a send completes at once, or when its receive is posted (MPI_Ssend: "
        "any ordering that can deadlock on a real MPI deadlocks here, named at once)",
    )
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)


def _benches() -> dict:
    """Every `minidist bench X`, by X; each benchmark keeps its flags and measurements beside
    its technique, on the skeleton of minidist/bench.py."""
    from minidist.collectives.bench import ALLREDUCE, P2P
    from minidist.context_parallel.bench import CP
    from minidist.data_parallel.bench import DP
    from minidist.expert_parallel.bench import MOE
    from minidist.large_batches.bench import BATCH
    from minidist.pipeline.bench import PIPELINE
    from minidist.sgd.bench import SGD
    from minidist.tensor_parallel.bench import TP
    from minidist.zero.bench import ZERO

    every = (ALLREDUCE, P2P, DP, TP, PIPELINE, ZERO, SGD, BATCH, MOE, CP)
    return {bench.name: bench for bench in every}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure: collectives and every technique")
    kinds = p.add_subparsers(dest="what", required=True)
    for bench in _benches().values():
        bench.add_parser(kinds)


def _add_train(sub) -> None:
    from minidist.gpt import cli as train_cli

    train_cli.add_parser(sub)


def _add_sample(sub) -> None:
    from minidist.gpt import sample

    sample.add_parser(sub)


def _add_schedule(sub) -> None:
    from minidist.pipeline.draw import add_schedule_command

    add_schedule_command(sub)


def _add_plan(sub) -> None:
    from minidist.cluster import cli as plan_cli

    plan_cli.add_parser(sub)


def _add_conform(sub) -> None:
    from minidist.conform import command as conform_command

    conform_command.add_parser(sub)


# every subcommand, in the order --help lists them, and the function that adds its parser: each
# imports its own module when called (the main job imports every technique and torch; the
# planner neither)
COMMANDS = {
    "run": _add_run,
    "bench": _add_bench,
    "train": _add_train,
    "sample": _add_sample,
    "schedule": _add_schedule,
    "plan": _add_plan,
    "conform": _add_conform,
}


def build_parser(command: str | None = None) -> Parser:
    """The whole command: every subcommand and its flags; or, given the subcommand a command
    line names, that one alone, so that only its module is imported (`minidist plan` imports
    no torch: tests/test_plan_input.py checks it)."""
    parser = Parser(prog="minidist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if command in (None, name):
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if not a.startswith("-")), None)  # the subcommand, if any
    args = build_parser(named if named in COMMANDS else None).parse_args(argv)
    found = numeric_problems(args) + command_problems(args)
    if args.command == "train":
        from minidist.gpt import cli as train_cli

        found = train_cli.problems(args, found)
    if found:  # before anything starts: one line per reason
        print("\n".join(f"minidist {args.command}: {why}" for why in found), file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

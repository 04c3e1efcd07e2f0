"""The conformance kit: minidist's property tests, restated against an adapter, so that they
judge someone else's implementation (`minidist conform ADAPTER`).

Equals: what each capability's checks say (the single-process program and the tolerance, in
each capability module's docstring), on every rank, for world sizes 1..8 on the strict threads
world and 1..4 over gloo and mpi processes. Cases are fixed hard ones, then hypothesis's,
derandomized: every run judges the same cases. Lesson: lessons/appendix_conformance/.
Run: minidist conform minidist   (or: python -m minidist.conform.mutants, the mutation score)

adapter.py          the adapter interface (every function a capability may call), loading one,
                    the communicator handed to it and the bytes it sends
checks.py           a check as data (needs, cases, run on every rank, judge in the kit), and
                    the comparisons every check shares
collectives.py      capability "collectives": all-reduce, reduce-scatter, all-gather, broadcast,
                    all-to-all, and their bytes against the ring/tree/direct formulas
data_parallel.py    capability "dp": a data-parallel wrapper against one process
tensor_parallel.py  capability "tp": column- and row-parallel linear, the parallel MLP
pipeline.py         capability "pp": GPipe and 1F1B schedules as data, a pipelined step against
                    one process
moe.py              capability "moe": an expert-parallel mixture of experts against one process
context_parallel.py capability "cp": ring attention, causal and not, against one process
zero.py             capability "zero": ZeRO stages 1-3 with AdamW against one process; the
                    shards of state and gradient, the bytes held against the paper's formula
registry.py         every capability by its --only name
runner.py           the checks on thread-ranks or in one process job per capability
report.py           the table, --json, --junit
command.py          `minidist conform` (only parses; the kit loads when it runs)
ours.py             minidist's own adapter; mutants.py: it with one bug planted, each

Adding a capability (pipeline, zero, moe, cp): name its adapter functions in adapter.py's
docstring, write <capability>.py with CHECKS, a list of checks.Check (each a run() that calls
the adapter on every rank and returns detached tensors, and a judge() that builds the
single-process reference from the case's seed and compares every rank's outputs), add it to
registry.CAPABILITIES, give ours.py the functions (everything must pass) and mutants.py a few
planted bugs (every one must be caught).
"""

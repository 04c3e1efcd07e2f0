"""Expert parallelism measured: the MoE dispatch's all-to-all, hand-written beside the library's,
and the assignments dropped against the capacity factor, each beside its formula.

    minidist bench moe -n 4 --backend mpi [--tokens 256 1024 4096] [--d-model 256]
                       [--experts 8] [--k 1] [--cf 0.5 1 1.25 1.5 2] [--json]

Part 1, the dispatch, one row per --tokens n: every rank routes n tokens (N(0, 1), seed =
rank) of D float32 with a Router (E experts, top-k, seed 0, no capacity) and sends the rows to
their experts' ranks:
    hand      collectives.all_to_all, the counts known (the MoE exchanges them before, per expert)
    library   the same counts through MPI_Alltoallv (mpi4py) on mpi, all_to_all_single on gloo;
              none on threads. `same`: both delivered the same rows
    sent      bytes sent in the hand-written one (ObservedComm), the busiest rank's, beside the
              all-to-all formula (N - n_rr) D b (collectives/algorithms.py): the rows for other
              ranks
    model     the alpha-beta time (p-1) a + sent / B, a and B fitted by least squares to the
              hand-written rows' times (two --tokens at least; lesson 02's model)
and one ExpertParallelMoE forward + backward at the first n (d_ff = D, capacity factor 1.25):
each rank's bytes sent beside step_nbytes (m, m' from every rank's routing): `step`.

Part 2, the drops, one row per --cf: C = ceil(cf k n / E); the fraction of assignments dropped
    balanced  a router that spreads every group's k n assignments evenly: formula
    uniform   choices drawn uniformly at random (k distinct experts a token), measured over
              --trials groups per rank with keep_mask, beside the formula: an expert's load X is
              Binomial(n, k/E), so drop = E * E[(X - C)+] / (k n)
    router    the Router itself (seed 0, untrained) on the ranks' tokens: skewed, no formula;
              max/mean is its busiest expert's first-choice load over the mean n / E

Times: the median of --iters calls, each started together, the slowest rank's (a shared machine:
read the hand / library ratio within one run). Bytes and the formulas are exact.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from minidist.bench import Bench, all_ranks, max_over_ranks, rank_main, time_it
from minidist.cluster import hardware as cluster
from minidist.collectives import algorithms as collectives
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.expert_parallel import moe as expert_parallel

F32 = torch.float32  # the benchmark's dtype: b = 4 bytes in every formula


def library_all_to_all(comm):
    """fn(x, y, send_counts, recv_counts): the library's all-to-all of x's rows into y (both
    contiguous float32 (rows, D) on the CPU), called directly; None on threads."""
    if comm.backend == "mpi":
        from mpi4py import MPI

        def alltoallv(x, y, send_counts, recv_counts):
            d = x[0].numel() if x.shape[0] else y[0].numel()  # elements per row
            specs = []
            for buf, counts in ((x, send_counts), (y, recv_counts)):
                sizes = [c * d for c in counts]  # elements, not rows
                specs.append([buf.numpy(), (sizes, [sum(sizes[:i]) for i in range(len(sizes))])])
            MPI.COMM_WORLD.Alltoallv(*specs)

        return alltoallv
    if comm.backend == "gloo":
        import torch.distributed as dist

        return lambda x, y, s, r: dist.all_to_all_single(y, x, r, s)
    return None


def dispatch_rows(comm, n: int, args) -> tuple[torch.Tensor, list[int]]:
    """(rows sorted by destination rank (N, D), send_counts): this rank's routed tokens."""
    router = expert_parallel.Router(args.d_model, args.experts, args.k, None, dtype=F32)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(n, args.d_model, generator=gen)  # (n, D)
    with torch.no_grad():
        routing = router(x)  # sorted by expert, so by rank
    per_rank = routing.counts.view(comm.world_size, -1).sum(1).tolist()
    return x[routing.token].contiguous(), per_rank  # (N, D), N = k n


def dispatch_row(comm, n: int, args) -> dict:
    """One row of part 1: times, bytes sent (measured, formula), the same rows delivered."""
    p, r = comm.world_size, comm.rank
    x, send_counts = dispatch_rows(comm, n, args)
    counts = torch.tensor(send_counts, dtype=torch.int64)
    recv_counts = collectives.all_to_all(counts, [1] * p, comm, [1] * p)[0].tolist()
    counter = Counter()
    y, _ = collectives.all_to_all(x, send_counts, ObservedComm(comm, counter), recv_counts)
    formula = (x.shape[0] - send_counts[r]) * args.d_model * 4  # (N - n_rr) D b
    call = lambda: collectives.all_to_all(x, send_counts, comm, recv_counts)  # noqa: E731
    hand = time_it(comm, call, args.iters, warmup=2)
    row = {"tokens": n, "rows": x.shape[0], "hand_us": hand * 1e6, "library_us": None}
    row |= {
        "sent": max_over_ranks(comm, counter.bytes_sent),
        "formula": max_over_ranks(comm, formula),
    }
    row["sent_ok"] = all_ranks(comm, counter.bytes_sent == formula)
    library, same = library_all_to_all(comm), True
    if library is not None:
        y_lib = torch.empty_like(y)
        call = lambda: library(x, y_lib, send_counts, recv_counts)  # noqa: E731
        row["library_us"] = time_it(comm, call, args.iters, warmup=2) * 1e6
        same = torch.equal(y, y_lib)
    row["same"] = all_ranks(comm, same)
    return row


def fit(rows: list[dict], p: int) -> dict | None:
    """{a_us, B_GBs} of time = (p-1) a + sent / B over the rows, or None (too few or noisy);
    each row gains model_us."""
    try:
        link = cluster.calibrated([{"nbytes": r["sent"], "time_us": r["hand_us"]} for r in rows])
    except ValueError:
        return None
    for r in rows:
        r["model_us"] = (link.latency + r["sent"] / link.bandwidth) * 1e6
    return {"a_us": link.latency / max(1, p - 1) * 1e6, "B_GBs": link.bandwidth / 1e9}


def step_bytes(comm, n: int, args) -> dict:
    """ExpertParallelMoE forward + backward: bytes sent (busiest rank), beside step_nbytes."""
    p, r = comm.world_size, comm.rank
    counter = Counter()
    d, c = args.d_model, ObservedComm(comm, counter)
    layer = expert_parallel.ExpertParallelMoE(d, d, args.experts, c, args.k, 1.25, dtype=F32)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(n, args.d_model, generator=gen).requires_grad_()  # (n, D)
    with torch.no_grad():
        kept = layer.router(x).counts.view(p, -1).sum(1).to(torch.float64)  # (p,) to each rank
    matrix = torch.empty(p * p, dtype=torch.float64)
    comm.all_gather(matrix, kept)  # row i: what rank i sends to each rank
    matrix = matrix.view(p, p)
    m, m_in = matrix[r].sum() - matrix[r, r], matrix[:, r].sum() - matrix[r, r]
    y, aux = layer(x)
    (y.sum() + aux).backward()
    formula = expert_parallel.step_nbytes(int(m), int(m_in), args.d_model, 4, layer.n_local, p)
    row = {
        "tokens": n,
        "sent": max_over_ranks(comm, counter.bytes_sent),
        "formula": max_over_ranks(comm, formula),
    }
    return row | {"sent_ok": all_ranks(comm, counter.bytes_sent == formula)}


def uniform_drop(n: int, k: int, n_experts: int, cap: int) -> float:
    """E * E[(X - C)+] / (k n), X ~ Binomial(n, k/E): the expected fraction of assignments
    dropped when every token picks k distinct experts uniformly at random."""
    q = k / n_experts
    if q >= 1:
        return max(0, n - cap) * n_experts / (k * n)
    excess = 0.0
    for x in range(cap + 1, n + 1):
        log_pmf = math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
        excess += (x - cap) * math.exp(log_pmf + x * math.log(q) + (n - x) * math.log1p(-q))
    return n_experts * excess / (k * n)


def balanced_drop(n: int, k: int, n_experts: int, cap: int) -> float:
    """The fraction dropped when the k n assignments are spread as evenly as they can be."""
    q, rem = divmod(k * n, n_experts)
    over = rem * max(0, q + 1 - cap) + (n_experts - rem) * max(0, q - cap)
    return over / (k * n)


def drop_row(comm, cf: float, args) -> dict:
    """One row of part 2: capacity, and the three dropped fractions with the two formulas."""
    n = args.tokens[0]
    k = args.k
    e = args.experts
    cap = expert_parallel.capacity(cf, k, n, e)
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    dropped = 0
    for _ in range(args.trials):
        choices = torch.rand(n, e, generator=gen).argsort(-1)[:, :k]  # (n, k) distinct, uniform
        dropped += int((~expert_parallel.keep_mask(choices, e, cap)).sum())
    router = expert_parallel.Router(args.d_model, e, k, cf, dtype=F32)
    x = torch.randn(n, args.d_model, generator=torch.Generator().manual_seed(comm.rank))
    with torch.no_grad():
        routing = router(x)
    sums = torch.tensor([dropped, routing.dropped, routing.first.max()], dtype=torch.float64)
    sums = comm.all_reduce(sums, "sum")  # the ranks' groups together
    p = comm.world_size
    return {
        "cf": cf,
        "capacity": cap,
        "balanced": balanced_drop(n, k, e, cap),
        "uniform": sums[0].item() / (args.trials * p * k * n),
        "uniform_formula": uniform_drop(n, k, e, cap),
        "router": sums[1].item() / (p * k * n),
        "router_max_over_mean": sums[2].item() / p / (n / e),
    }


def report(result: dict, args: argparse.Namespace) -> str:
    """Part 1's and part 2's tables, with the formulas beside the measurements."""
    cfg, p = result["config"], result["world_size"]
    lines = [
        f"# minidist bench moe: {result['backend']}, {p} ranks, E={cfg['experts']} k={cfg['k']} "
        f"D={cfg['d_model']}, float32",
        "# dispatch: all-to-all of every routed row (no capacity); sent = busiest rank's bytes",
        f"{'tokens':>7}{'rows':>7}{'hand us':>10}{'library us':>11}{'hand/lib':>9}"
        f"{'sent B':>11}{'formula':>11}{'model us':>10}  same",
    ]
    for r in result["dispatch"]:
        lib = "-" if r["library_us"] is None else f"{r['library_us']:.1f}"
        ratio = "-" if r["library_us"] is None else f"{r['hand_us'] / r['library_us']:.2f}"
        model = f"{r['model_us']:.1f}" if "model_us" in r else "-"
        lines.append(
            f"{r['tokens']:>7}{r['rows']:>7}{r['hand_us']:10.1f}{lib:>11}{ratio:>9}"
            f"{r['sent']:11.0f}{r['formula']:11.0f}{model:>10}  {'yes' if r['same'] else 'NO'}"
        )
    fitted = result["fit"]
    if fitted:
        lines.append(
            f"# model: (p-1) a + sent / B, fitted: a = {fitted['a_us']:.1f} us, "
            f"B = {fitted['B_GBs']:.2f} GB/s"
        )
    step = result["step"]
    lines.append(
        f"# ExpertParallelMoE fwd+bwd, n={step['tokens']}, cf 1.25: sent {step['sent']:.0f} B "
        f"(busiest rank), step_nbytes {step['formula']:.0f} B, every rank equal: "
        f"{'yes' if step['sent_ok'] else 'NO'}"
    )
    lines += drops_table(result)
    lines.append("# times: one run on a shared machine (noisy); bytes and formulas: exact")
    return "\n".join(lines)


def drops_table(result: dict) -> list[str]:
    """Part 2's lines: capacity and the dropped fractions, formulas beside."""
    cfg, p = result["config"], result["world_size"]
    n = cfg["tokens"][0]
    lines = [
        f"# drops: fraction of the k n = {cfg['k'] * n} assignments per group dropped "
        f"({p} groups of n = {n}; uniform: {cfg['trials']} groups per rank)",
        f"{'cf':>6}{'C':>6}{'balanced':>10}{'uniform':>9}{'formula':>9}{'router':>8}"
        f"{'max/mean':>9}",
    ]
    for r in result["drops"]:
        lines.append(
            f"{r['cf']:6.2f}{r['capacity']:>6}{r['balanced']:10.3f}{r['uniform']:9.3f}"
            f"{r['uniform_formula']:9.3f}{r['router']:8.3f}{r['router_max_over_mean']:9.2f}"
        )
    return lines


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096], help="per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, choices=(1, 2), default=1)
    p.add_argument("--cf", type=float, nargs="+", default=[0.5, 1.0, 1.25, 1.5, 2.0])
    p.add_argument("--trials", type=int, default=20, help="uniform groups per rank")
    p.add_argument("--iters", type=int, default=20, help="timed all-to-alls per row")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks)."""
    if args.experts % args.n == 0 and args.k <= args.experts:
        return []
    return [f"--experts {args.experts} must be a multiple of -n {args.n} and at least --k {args.k}"]


def measure(comm, args: argparse.Namespace) -> dict:
    """Both parts, as --json prints them."""
    rows = [dispatch_row(comm, n, args) for n in args.tokens]
    result = {"bench": "moe", "backend": comm.backend, "world_size": comm.world_size}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "result")}
    result |= {"config": config, "dispatch": rows}
    result |= {"fit": fit(rows, comm.world_size), "step": step_bytes(comm, args.tokens[0], args)}
    result["drops"] = [drop_row(comm, cf, args) for cf in args.cf]
    return result


MOE = Bench(
    "moe",
    "MoE: all-to-all hand-written vs library; drops vs capacity",
    __name__,
    flags,
    measure,
    report,
    problems,
    ranks=4,
    ranks_help="ranks (the ep group)",
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], MOE)

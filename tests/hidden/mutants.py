"""Wrong solutions of every lab, planted into the reference to prove the lab's tests catch them.

Each Mutant replaces `old`, an exact snippet of the reference module inside the region of its
task, by `new`; `tools/labs.py mutants` grades each with the lesson's public and hidden tests,
and every one must lose points. They are the classic mistakes of each topic: a send before its
receive (deadlocks under rendezvous sends), code right only for p = 2 or for sizes divisible
by p, a missing average, an order of reduction that differs across ranks, a rank that skips a
collective, and each technique's own (a bucket launched out of order, a missing f or g, a
schedule that stashes too much, a shard boundary off by one, a stale parameter, ...).
test_mutants_catalogue.py keeps every snippet true to its module and region.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    lab: str  # "02"
    task: str  # "02.1": the task whose region it changes
    name: str  # "send before receive (deadlocks under rendezvous)"
    old: str  # an exact snippet of the reference module (inside that task's region)
    new: str  # its replacement
    module: int = 0  # which part of the lab (lab 12 has two: mesh.py, gpt/train.py)


MUTANTS: list[Mutant] = [
    # ---- 01: point-to-point on the threads backend (minidist/comm/threads.py) ----------------
    Mutant(
        "01",
        "01.1",
        "no copy: the message aliases the sender's buffer, which it may overwrite at once",
        "msg = t.detach().clone()  # buffered: the sender may overwrite t right away",
        "msg = t.detach()",
    ),
    Mutant(
        "01",
        "01.1",
        "message filed under (dst, rank): the receiver looks in the other mailbox",
        "self.world.mailbox.setdefault((self.rank, dst, tag), deque()).append(msg)",
        "self.world.mailbox.setdefault((dst, self.rank, tag), deque()).append(msg)",
    ),
    Mutant(
        "01",
        "01.1",
        "newest message first (appendleft): messages on one channel overtake each other",
        "self.world.mailbox.setdefault((self.rank, dst, tag), deque()).append(msg)",
        "self.world.mailbox.setdefault((self.rank, dst, tag), deque()).appendleft(msg)",
    ),
    Mutant(
        "01",
        "01.2",
        "pops the newest message (LIFO): messages on one channel overtake each other",
        "msg = box.popleft()",
        "msg = box.pop()",
    ),
    Mutant(
        "01",
        "01.2",
        "no size or dtype check: a float64 message is cast into a float32 buffer",
        "if msg.numel() != self.t.numel() or msg.dtype != self.t.dtype:",
        "if False:",
    ),
    Mutant(
        "01",
        "01.2",
        "waits on the timeout alone (no rank, call, peer): a deadlock is never named",
        "world.wait(lambda: bool(box), what, self.comm.timeout, rank, call, peers, self._note)",
        "world.wait(lambda: bool(box), what, self.comm.timeout)",
    ),
    Mutant(
        "01",
        "01.2",
        "copies into a flattened copy of a non-contiguous buffer (right only if contiguous)",
        "self.t.copy_(msg.reshape(self.t.shape))",
        "self.t.reshape(-1).copy_(msg.reshape(-1))",
    ),
    # ---- 02: collectives from send/recv (minidist/collectives/algorithms.py) ---------------------
    Mutant(
        "02",
        "02.1",
        "send before receive: each rank waits for its send first (deadlocks under rendezvous)",
        "        sends = _isend_fragments(buf[lo:hi], comm, right, fragment)\n"
        "        _recv_reduce_fragments(buf[rlo:rhi], comm, left, op, fragment, scratch)",
        "        for send in _isend_fragments(buf[lo:hi], comm, right, fragment):\n"
        "            send.wait()\n"
        "        sends = []\n"
        "        _recv_reduce_fragments(buf[rlo:rhi], comm, left, op, fragment, scratch)",
    ),
    Mutant(
        "02",
        "02.1",
        "chunks of N // p elements: the remainder is never reduced (right only if p divides N)",
        "        lo, hi = bounds[(r - s - 1) % p]  # reduced in the previous step"
        " (s=0: this rank's own)\n"
        "        rlo, rhi = bounds[(r - s - 2) % p]  # it arrives holding the reduction"
        " over s+1 ranks",
        "        n = buf.numel() // p\n"
        "        lo, hi = (r - s - 1) % p * n, ((r - s - 1) % p + 1) * n\n"
        "        rlo, rhi = (r - s - 2) % p * n, ((r - s - 2) % p + 1) * n",
    ),
    Mutant(
        "02",
        "02.1",
        "chunk indices ignore the step (right only for p = 2)",
        "        lo, hi = bounds[(r - s - 1) % p]  # reduced in the previous step"
        " (s=0: this rank's own)\n"
        "        rlo, rhi = bounds[(r - s - 2) % p]  # it arrives holding the reduction"
        " over s+1 ranks",
        "        lo, hi = bounds[(r - 1) % p]\n        rlo, rhi = bounds[(r - 2) % p]",
    ),
    Mutant(
        "02",
        "02.1",
        "always adds: max and min come out as sums",
        "_recv_reduce_fragments(buf[rlo:rhi], comm, left, op, fragment, scratch)",
        '_recv_reduce_fragments(buf[rlo:rhi], comm, left, "sum", fragment, scratch)',
    ),
    Mutant(
        "02",
        "02.2",
        "blocking send before receive in the all-gather (deadlocks under rendezvous)",
        "        recv = comm.irecv(buf[rlo:rhi], left)  # received in place: no copy,"
        " no reduction\n"
        "        send = comm.isend(buf[lo:hi], right)\n"
        "        recv.wait()\n"
        "        send.wait()  # keep at most one send in flight",
        "        comm.send(buf[lo:hi], right)\n        comm.recv(buf[rlo:rhi], left)",
    ),
    Mutant(
        "02",
        "02.2",
        "passes its own chunk on every step (right only for p = 2)",
        "lo, hi = bounds[(r - s) % p]",
        "lo, hi = bounds[r]",
    ),
    Mutant(
        "02",
        "02.3",
        "each rank folds its own value first: signed zeros differ across ranks",
        "        if v < pv:\n"
        "            reduce_(acc, got, op)\n"
        "        else:\n"
        "            reduce_(got, acc, op)\n"
        "            acc, got = got, acc",
        "        reduce_(acc, got, op)",
    ),
    Mutant(
        "02",
        "02.3",
        "the partner's virtual rank taken as its real rank (right only for powers of two)",
        "peer = 2 * pv + 1 if pv < extra else pv + extra  # virtual rank -> real rank",
        "peer = pv",
    ),
    Mutant(
        "02",
        "02.3",
        "both partners send before they receive (deadlocks under rendezvous)",
        "        recv = comm.irecv(got, peer)  # both posted before either waits: they overlap\n"
        "        send = comm.isend(acc, peer)\n"
        "        recv.wait()\n"
        "        # the fold below may overwrite acc, and the next round receives into got:"
        " the send\n"
        "        # of acc must have left first\n"
        "        send.wait()",
        "        comm.send(acc, peer)\n        comm.recv(got, peer)",
    ),
    # ---- 03: debug mode (minidist/comm/checked.py) ---------------------------------------------
    Mutant(
        "03",
        "03.1",
        "raises only where the signature differs from rank 0's: the others walk into the hang",
        "if len(set(sigs)) > 1:",
        "if sigs[self.rank] != sigs[0]:",
    ),
    Mutant(
        "03",
        "03.1",
        "compares its own signature with itself (no all-gather)",
        "self.inner.all_gather(rows, _encode(sig).to(self.device))",
        "rows[:] = _encode(sig).to(self.device)",
    ),
    Mutant(
        "03",
        "03.2",
        "checks the element count only: a float64 message passes into a float32 buffer",
        "if numel != t.numel() or dtype != t.dtype:",
        "if numel != t.numel():",
    ),
    Mutant(
        "03",
        "03.2",
        "checks the dtype only: a message of another size passes",
        "if numel != t.numel() or dtype != t.dtype:",
        "if dtype != t.dtype:",
    ),
    # ---- 04: data parallelism (minidist/data_parallel/wrappers.py) -------------------------------
    Mutant(
        "04",
        "04.1",
        "a bucket closes only past bucket_bytes (> instead of >=)",
        "if filled >= bucket_bytes:",
        "if filled > bucket_bytes:",
    ),
    Mutant(
        "04",
        "04.1",
        "the last, partial bucket is dropped",
        "    if current:\n        buckets.append(current)\n    return buckets",
        "    return buckets",
    ),
    Mutant(
        "04",
        "04.2",
        "any full bucket is launched at once, out of order (ranks disagree where one is unused)",
        "        while self.next_launch < len(self.buckets):\n"
        "            bucket = self.buckets[self.next_launch]\n"
        "            if not (all_remaining or all(bucket.ready)):\n"
        "                return\n"
        "            bucket.launch(self.launcher)\n"
        "            self.next_launch += 1",
        "        for bucket in self.buckets:\n"
        "            if bucket.work is None and (all_remaining or all(bucket.ready)):\n"
        "                bucket.launch(self.launcher)",
    ),
    Mutant(
        "04",
        "04.2",
        "a bucket is launched when its first gradient arrives",
        "if not (all_remaining or all(bucket.ready)):",
        "if not (all_remaining or any(bucket.ready)):",
    ),
    Mutant(
        "04",
        "04.3",
        "missing average: the gradients enter the bucket undivided and come back summed",
        "torch.div(param.grad.reshape(-1), p, out=view)",
        "view.copy_(param.grad.reshape(-1))",
    ),
    Mutant(
        "04",
        "04.3",
        "a rank without a gradient leaves the bucket's last contents in the sum",
        "        view.zero_()",
        "        pass",
    ),
    Mutant(
        "04",
        "04.4",
        "a parameter no rank used gets a zero gradient (the optimizer then moves it)",
        "param.grad = None  # no rank used it: as in one process",
        "param.grad = view.view_as(param).zero_()",
    ),
    Mutant(
        "04",
        "04.4",
        "views asked for, but each .grad gets a copy of its average (a second buffer)",
        "        elif as_views:\n            param.grad = view.view_as(param)\n        elif",
        "        elif as_views:\n"
        "            param.grad = view.view_as(param).clone()\n"
        "        elif",
    ),
    # ---- 05: tensor parallelism (minidist/tensor_parallel/layers.py) -----------------------------
    Mutant(
        "05",
        "05.1",
        "the bias added to every partial result before g: counted p times",
        "        y_partial = F.linear(x, self.weight)  # (.., O): this rank's share of the"
        " sum over I",
        "        y_partial = F.linear(x, self.weight, self.bias)\n"
        "        if self.bias is not None:\n"
        "            return g(y_partial, comm)",
    ),
    Mutant(
        "05",
        "05.1",
        "missing g: the partial results are never summed",
        "y = g(y_partial, comm)  # (.., O), the same on every rank",
        "y = y_partial",
    ),
    Mutant(
        "05",
        "05.1",
        "missing f on the bias with sequence parallelism: its gradient sees T/p tokens",
        "return y + (f(self.bias, comm) if self.sequence_parallel else self.bias)",
        "return y + self.bias",
    ),
    Mutant(
        "05",
        "05.2",
        "shifts by this rank's max, not the max over all ranks",
        'comm.all_reduce(m, "max")  # the same shift on every rank: exp() cannot overflow',
        "# each rank shifts by its own max",
    ),
    Mutant(
        "05",
        "05.2",
        "every rank adds its own 'target' logit (not masked by who owns the target)",
        "z_target = z.gather(-1, idx[..., None])[..., 0] * mine  # (..) zero unless mine",
        "z_target = z.gather(-1, idx[..., None])[..., 0]",
    ),
    Mutant(
        "05",
        "05.3",
        "dL/dx split instead of reduce-scattered: a missing f (each rank keeps its part only)",
        "grad_x = reduce_scatter_along(grad_y @ w, ctx.comm, 1)  # (B, T/p, I)",
        "grad_x = (grad_y @ w).narrow(1, ctx.comm.rank * x_local.shape[1], x_local.shape[1])",
    ),
    Mutant(
        "05",
        "05.3",
        "no bias gradient under sequence parallelism",
        "grad_b = grad_rows.sum(0) if ctx.has_bias else None  # (O/p,)",
        "grad_b = torch.zeros_like(grad_rows[0]) if ctx.has_bias else None",
    ),
    # ---- 06: pipeline schedules (minidist/pipeline/schedules.py) ---------------------------------
    Mutant(
        "06",
        "06.1",
        "warmup of p - s forwards: every stage stashes one activation too many",
        "warmup = min(n_stages - stage - 1, m)",
        "warmup = min(n_stages - stage, m)",
    ),
    Mutant(
        "06",
        "06.1",
        "every stage warms up like stage 0: stashes p activations everywhere",
        "warmup = min(n_stages - stage - 1, m)",
        "warmup = min(n_stages - 1, m)",
    ),
    Mutant(
        "06",
        "06.1",
        "the steady phase runs the backward before the forward",
        "ops += _fwd(warmup + i) + backward(i)",
        "ops += backward(i) + _fwd(warmup + i)",
    ),
    Mutant(
        "06",
        "06.1",
        "warmup not capped at m (right only for m >= p)",
        "warmup = min(n_stages - stage - 1, m)",
        "warmup = n_stages - stage - 1",
    ),
    Mutant(
        "06",
        "06.2",
        "backwards take the chunks first to last",
        "return group * p + r % p, (v - 1 - r // p if backward else r // p)",
        "return group * p + r % p, r // p",
    ),
    Mutant(
        "06",
        "06.2",
        "groups of 2 microbatches per chunk (right only for p = 2)",
        "        group, r = divmod(k, p * v)\n"
        "        return group * p + r % p, (v - 1 - r // p if backward else r // p)",
        "        group, r = divmod(k, 2 * v)\n"
        "        return group * 2 + r % 2, (v - 1 - r // 2 if backward else r // 2)",
    ),
    # ---- 07: ZeRO (minidist/zero/stages.py) ------------------------------------------------------
    Mutant(
        "07",
        "07.1",
        "shard boundary off by one: each shard takes the next shard's first element",
        "lo, hi = max(off, first), min(off + n, last)",
        "lo, hi = max(off, first), min(off + n, last + 1)",
    ),
    Mutant(
        "07",
        "07.1",
        "a piece's place counted from its tensor's start, not the shard's",
        "found.append(Piece(i, lo - off, hi - off, lo - first))",
        "found.append(Piece(i, lo - off, hi - off, lo - off))",
    ),
    Mutant(
        "07",
        "07.2",
        "the full gradients are kept (ZeRO-2's memory saving lost)",
        "q.grad = None  # the full gradient goes: only this rank's shard will stay",
        "pass  # the full gradient stays",
    ),
    Mutant(
        "07",
        "07.2",
        "every parameter marked used: one without a gradient anywhere is stepped",
        "unit.used[i] = float(q.grad is not None)",
        "unit.used[i] = 1.0",
    ),
    Mutant(
        "07",
        "07.3",
        "the norm of this rank's shard only (no all-reduce)",
        "self.launcher.all_reduce(squares).wait()",
        "squares = squares  # no all-reduce",
    ),
    Mutant(
        "07",
        "07.3",
        "the coefficient is not capped at 1: small gradients are scaled up",
        "coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)",
        "coef = max_norm / (norm + 1e-6)",
    ),
    Mutant(
        "07",
        "07.3",
        "a rank whose shard holds no gradient skips the all-reduce",
        "self.launcher.all_reduce(squares).wait()",
        "if grads:\n            self.launcher.all_reduce(squares).wait()",
    ),
    # ---- 08: the parameter server (minidist/sgd/parameter_server.py) -----------------------------
    Mutant(
        "08",
        "08.2",
        "updates a new tensor (w = w - lr g): the server's shard stays stale",
        "self.w.sub_(self.lr * g)  # two roundings, as in the single-process reference",
        "self.w = self.w - self.lr * g",
    ),
    Mutant(
        "08",
        "08.2",
        "the event logs the version after the update (staleness off by one)",
        "        self.log.events.append(Event(link.worker, clock, link.pulled, self.version))\n"
        "        link.staleness = self.version - link.pulled\n"
        "        self.w.sub_(self.lr * g)  # two roundings, as in the single-process reference\n"
        "        self.version += 1",
        "        self.version += 1\n"
        "        self.log.events.append(Event(link.worker, clock, link.pulled, self.version))\n"
        "        link.staleness = self.version - link.pulled\n"
        "        self.w.sub_(self.lr * g)",
    ),
    Mutant(
        "08",
        "08.2",
        "the worker's clock is not counted: its next gradient is refused",
        "link.clock += 1",
        "pass  # the clock stays",
    ),
    Mutant(
        "08",
        "08.1",
        "answers every waiting worker: the staleness bound is ignored",
        "if link.waiting and (self.s is None or link.asked - slowest <= self.s):",
        "if link.waiting:",
    ),
    Mutant(
        "08",
        "08.1",
        "the slowest worker taken over all, gone ones too: the rest wait for one that left",
        "slowest = min((link.asked for link in self.live()), default=0)",
        "slowest = min((link.asked for link in self.links), default=0)",
    ),
    Mutant(
        "08",
        "08.3",
        "loses workers that are waiting for the bound, not computing",
        "if not link.waiting and now - link.heard > self.timeout:",
        "if now - link.heard > self.timeout:",
    ),
    Mutant(
        "08",
        "08.3",
        "never checks the deadlines: a silent worker is never dropped for its silence",
        "if not link.waiting and now - link.heard > self.timeout:",
        "if False:",
    ),
    # ---- 09: mixed precision (minidist/mixed_precision/amp.py) -----------------------------------
    Mutant(
        "09",
        "09.1",
        "decides on this rank's tensors alone: ranks skip different steps",
        '        comm.all_reduce(flag, "max")',
        "        flag = flag  # no agreement",
    ),
    Mutant(
        "09",
        "09.1",
        "a rank with no tensors returns before the all-reduce (skips the collective)",
        "    flag = torch.zeros(1, dtype=torch.float32, device=device)",
        "    if not tensors:\n"
        "        return False\n"
        "    flag = torch.zeros(1, dtype=torch.float32, device=device)",
    ),
    Mutant(
        "09",
        "09.1",
        "looks for nan only: an overflow to inf passes",
        "flag = torch.maximum(flag, (~torch.isfinite(t)).any().float())",
        "flag = torch.maximum(flag, torch.isnan(t).any().float())",
    ),
    Mutant(
        "09",
        "09.2",
        "backs off without restarting the count of clean steps",
        "            self.scale *= self.backoff_factor\n            self.clean_steps = 0",
        "            self.scale *= self.backoff_factor",
    ),
    Mutant(
        "09",
        "09.2",
        "grows one step late (past the interval, not at it)",
        "if self.clean_steps == self.growth_interval:",
        "if self.clean_steps > self.growth_interval:",
    ),
    Mutant(
        "09",
        "09.3",
        "decides on this rank alone (no overflow_comm): one rank skips, the others step",
        "found_inf = found_nonfinite([self.grad_flat], self.overflow_comm)",
        "found_inf = found_nonfinite([self.grad_flat])",
    ),
    Mutant(
        "09",
        "09.3",
        "skips without updating the scale",
        "        self.scaler.update(found_inf)\n"
        "        if found_inf:\n"
        "            self.skipped.append(self.steps)\n"
        "            return False",
        "        if found_inf:\n"
        "            self.skipped.append(self.steps)\n"
        "            return False\n"
        "        self.scaler.update(found_inf)",
    ),
    Mutant(
        "09",
        "09.3",
        "the masters step but are never copied into the model",
        "                param.copy_(master)  # round the updated master to the model's dtype",
        "                pass",
    ),
    # ---- 10: gradient checkpointing (minidist/checkpointing/recompute.py) ------------------------
    Mutant(
        "10",
        "10.1",
        "the last segment assumed full (s = k)",
        "s = n_blocks - (c - 1) * k  # blocks in the last segment, recomputed first",
        "s = k",
    ),
    Mutant(
        "10",
        "10.1",
        "the last segment's input still counted while a full one is recomputed",
        "full = (c - 2) * b + k * a if c > 1 else 0  # the last segment's input freed by now",
        "full = (c - 1) * b + k * a if c > 1 else 0",
    ),
    Mutant(
        "10",
        "10.2",
        "the random state is not restored: dropout draws another mask",
        "torch.set_rng_state(cpu_state)",
        "pass  # the generator is left where the forward left it",
    ),
    Mutant(
        "10",
        "10.2",
        "no fork_rng: the recomputation moves the generator training goes on with",
        "with torch.random.fork_rng(devices=list(cuda_states)), torch.enable_grad():",
        "with torch.enable_grad():",
    ),
    Mutant(
        "10",
        "10.2",
        "gradients for the inputs only: the parameters get none",
        "return (None, None, *[next(grads) if n else None for n in needs])",
        "return (None, None, *[next(grads) if n else None for n in needs[: len(saved)]],"
        " *[None for _ in ctx.params])",
    ),
    # ---- 11: learning-rate schedule (minidist/large_batches/lr.py) -------------------------------
    Mutant(
        "11",
        "11.1",
        "warm-up one step late: the peak is reached on step W, not W - 1",
        "return peak * (start + (1 - start) * (step + 1) / warmup_steps)",
        "return peak * (start + (1 - start) * step / warmup_steps)",
    ),
    Mutant(
        "11",
        "11.1",
        "warm-up from 0, ignoring start",
        "return peak * (start + (1 - start) * (step + 1) / warmup_steps)",
        "return peak * (step + 1) / warmup_steps",
    ),
    Mutant(
        "11",
        "11.2",
        "decay counted from step 0, not from the end of warm-up",
        "t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))",
        "t = min(1.0, step / max(1, total_steps))",
    ),
    Mutant(
        "11",
        "11.2",
        "decays to 0, not to final x peak",
        "return peak * (final + (1 - final) * shape)",
        "return peak * shape",
    ),
    Mutant(
        "11",
        "11.2",
        "a quarter cosine (cos(pi t / 2)) instead of the half one",
        "shape = (1.0 + math.cos(math.pi * t)) / 2",
        "shape = math.cos(math.pi * t / 2)",
    ),
    # ---- 12: the 3D grid (minidist/mesh.py) and the composition (minidist/gpt/train.py) --------
    Mutant(
        "12",
        "12.1",
        "cp left out of the divisors (right only for cp = 1)",
        "        d, rest = divmod(rank, self.pp * self.cp * self.tp)\n"
        "        s, rest = divmod(rest, self.cp * self.tp)",
        "        d, rest = divmod(rank, self.pp * self.tp)\n"
        "        s, rest = divmod(rest, self.tp)",
    ),
    Mutant(
        "12",
        "12.1",
        "pp and tp swapped: tp taken as the slower axis",
        "        s, rest = divmod(rest, self.cp * self.tp)\n        return d, s, rest % self.tp",
        "        t, s = divmod(rest // self.cp, self.pp)\n        return d, s, t",
    ),
    Mutant(
        "12",
        "12.2",
        "groups sliced on cp rank 0 (c dropped: right only for cp = 1)",
        "(d, s, t), c = self.coords(rank), self.cp_coord(rank)",
        "(d, s, t), c = self.coords(rank), 0",
    ),
    Mutant(
        "12",
        "12.2",
        "the dp group sliced along pp",
        "            return self.grid[:, s, c, t].tolist()",
        "            return self.grid[d, :, c, t].tolist()",
    ),
    Mutant(
        "12",
        "12.3",
        "split by the rank's coordinate, not its group's color",
        'subs = {axis: comm.split(layout.color(comm.rank, axis)) for axis in ("tp", "pp", "dp")}',
        "subs = {\n"
        "        axis: comm.split(layout.group(comm.rank, axis).index(comm.rank))\n"
        '        for axis in ("tp", "pp", "dp")\n'
        "    }",
    ),
    Mutant(
        "12",
        "12.4",
        "every stage takes stage 0's layers",
        "layer_ids = gpt.stage_layer_ids(config.model, config.pp, config.chunks, s)",
        "layer_ids = gpt.stage_layer_ids(config.model, config.pp, config.chunks, 0)",
        module=1,
    ),
    Mutant(
        "12",
        "12.4",
        "layers cut over the dp group instead of tp",
        "apply_tp(layers, mesh.tp_comm)",
        "apply_tp(layers, mesh.dp_comm)",
        module=1,
    ),
    Mutant(
        "12",
        "12.5",
        "recomputation not counted: 4 a per block always",
        "per_block = 6 * a if c.checkpointing else 4 * a  # recomputed: the forward's 2 run again",
        "per_block = 4 * a",
        module=1,
    ),
    Mutant(
        "12",
        "12.5",
        "the head's three loss all-reduces forgotten",
        "nbytes += a + 3 * loss_row  # f's backward; the loss's max, target logit, sum of exps",
        "nbytes += a",
        module=1,
    ),
    Mutant(
        "12",
        "12.6",
        "virtual stages ignored (every chunk taken as stage s)",
        "u = chunk * c.pp + s  # this chunk's virtual stage",
        "u = s",
        module=1,
    ),
    Mutant(
        "12",
        "12.6",
        "a header counted with the gradients too",
        "nbytes += ma  # gradients back",
        "nbytes += ma + 64",
        module=1,
    ),
    # ---- 13: the cluster cost model (minidist/cluster/hardware.py) -------------------------------
    Mutant(
        "13",
        "13.1",
        "the chain bound only: the network's stream across nodes ignored",
        "return max(chain, stream)",
        "return chain",
    ),
    Mutant(
        "13",
        "13.1",
        "the stream bound only: the hops' latencies in a row ignored",
        "return max(chain, stream)",
        "return stream",
    ),
    Mutant(
        "13",
        "13.1",
        "the chain's window never slides (the run of hops from hop 0 only)",
        "worst = max(worst, window)",
        "pass  # only the first window counts",
    ),
    Mutant(
        "13",
        "13.2",
        "the ring across nodes carries the node's whole message, not its 1/g",
        "return inside + 2 * (n - 1) * (net.latency + nbytes / g / n / net.bandwidth)",
        "return inside + 2 * (n - 1) * (net.latency + nbytes / n / net.bandwidth)",
    ),
    Mutant(
        "13",
        "13.2",
        "the two rings inside the node counted once",
        "inside = 2 * (g - 1) * (cluster.intra.latency + nbytes / g / cluster.intra.bandwidth)",
        "inside = (g - 1) * (cluster.intra.latency + nbytes / g / cluster.intra.bandwidth)",
    ),
    # ---- 14: expert parallelism (minidist/expert_parallel/moe.py) --------------------------------
    Mutant(
        "14",
        "14.1",
        "token-major order: a token's second choice goes before the next token's first",
        "order = choices.t().reshape(-1)  # (k n,): first choices in token order, then the second",
        "order = choices.reshape(-1)",
    ),
    Mutant(
        "14",
        "14.1",
        "capacity off by one: cap + 1 assignments kept",
        "keep = position < cap",
        "keep = position <= cap",
    ),
    Mutant(
        "14",
        "14.2",
        "f from the probabilities: the loss's gradient flows through f too",
        "f = first.to(probs.dtype) / n  # (E,)",
        "f = probs.mean(0)",
    ),
    Mutant(
        "14",
        "14.2",
        "the factor E forgotten",
        "return alpha * n_experts * (f * p_mean).sum()",
        "return alpha * (f * p_mean).sum()",
    ),
    Mutant(
        "14",
        "14.3",
        "outputs sent back with the dispatch's counts (right only when they are symmetric)",
        "back = AllToAll.apply(out, recv_counts, send_counts, comm)  # (m, D), routing's order",
        "back = AllToAll.apply(out, send_counts, recv_counts, comm)",
    ),
    Mutant(
        "14",
        "14.3",
        "counts per rank taken as counts per expert (right only with one expert per rank)",
        "out = self.run_local(arrived, got)  # (M, D)",
        "out = self.run_local(arrived, got.sum(1, keepdim=True).expand(p, n_local) // n_local)",
    ),
    # ---- 15: context parallelism (minidist/context_parallel/ring_attention.py) -------------------
    Mutant(
        "15",
        "15.1",
        "merges through exp(lse): overflows to inf / inf = nan",
        "    new = torch.logaddexp(lse, lse_block)  # (B, H, m): log of the two normalizers' sum\n"
        "    weight, weight_block = torch.exp(lse - new), torch.exp(lse_block - new)  # sum to 1",
        "    total = torch.exp(lse) + torch.exp(lse_block)\n"
        "    new = torch.log(total)\n"
        "    weight, weight_block = torch.exp(lse) / total, torch.exp(lse_block) / total",
    ),
    Mutant(
        "15",
        "15.1",
        "averages the two sides instead of weighting them",
        "mixed = out * weight.unsqueeze(-1) + out_block * weight_block.unsqueeze(-1)",
        "mixed = (out + out_block) / 2",
    ),
    Mutant(
        "15",
        "15.2",
        "blocking send of k|v before the receive (deadlocks under rendezvous)",
        "                kv_next, works = pass_on(kv, comm, kv_tag)",
        "                comm.send(kv, (comm.rank + 1) % cp, kv_tag)\n"
        "                kv_next, works = torch.empty_like(kv), []\n"
        "                comm.recv(kv_next, (comm.rank - 1) % cp, kv_tag)",
    ),
    Mutant(
        "15",
        "15.2",
        "passes k|v on after the last step too (a message no one receives)",
        "            if step < cp - 1:  # started first: the transfer overlaps this step's compute",
        "            if True:",
    ),
    Mutant(
        "15",
        "15.2",
        "keeps the old block named through the next step: three blocks in flight, not two",
        "kv, works = kv_next, []  # a send's handle may hold the old block: drop both",
        "old, kv, works = kv, kv_next, []  # the old block stays named: alive a step longer",
    ),
    Mutant(
        "15",
        "15.3",
        "dS without delta: the softmax's backward loses its row sum",
        "grad_s = p * (grad_p - delta.unsqueeze(-1)) * scale",
        "grad_s = p * grad_p * scale",
    ),
    Mutant(
        "15",
        "15.3",
        "dS not scaled: dq and dk off by sqrt(d)",
        "grad_s = p * (grad_p - delta.unsqueeze(-1)) * scale",
        "grad_s = p * (grad_p - delta.unsqueeze(-1))",
    ),
]

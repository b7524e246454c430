"""Schedulers for chunk graphs (mllm-NPU §3.4): in-order, the out-of-order heuristic (eq. 6), an exact optimum.

All three produce a Schedule: for each subgraph its lane, start and end (µs), under the constraints of
§3.4 — every dependency finished before a subgraph starts (plus the cost model's sync cost when it crosses
lanes), and one subgraph at a time per lane (eq. 4).

- in-order: each lane runs its subgraphs in chunk-major program order (chunk, layer, stage): the naive
  overlap of Fig. 13(a).
- ooo: whenever a lane is free, among its ready subgraphs pick the largest contribution C (eq. 6): for a
  CPU/GPU subgraph, the NPU time of the subgraphs its completion makes ready; for an NPU subgraph, minus
  the CPU/GPU time it makes ready. Ties go to program order.
- exact: branch and bound over lane orders for small instances (at most MAX_EXACT subgraphs); the
  optimum is a semi-active schedule, so enumerating topological orders and starting each subgraph as early
  as its lane and dependencies allow finds it.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from .cost import CostModel
from .graph import STAGES, ChunkGraph, ScheduleError

MAX_EXACT = 12
SCHEDULERS = ("in-order", "ooo", "exact")


@dataclass
class Schedule:
    scheduler: str
    graph: ChunkGraph
    cost_model: CostModel
    slots: dict              # name -> (lane, start_us, end_us)
    decision_us: float = 0.0  # mean wall time per scheduling decision (ooo)
    decisions: int = 0

    @property
    def profile(self) -> CostModel:
        """The cost model's old name, kept for code written against it."""
        return self.cost_model

    @property
    def makespan_us(self) -> float:
        return max(e for _, _, e in self.slots.values()) - min(s for _, s, _ in self.slots.values())

    def busy(self) -> dict:
        span = max(self.makespan_us, 1e-9)
        out = {}
        for lane in sorted({l for l, _, _ in self.slots.values()}):
            out[lane] = 100.0 * sum(e - s for l, s, e in self.slots.values() if l == lane) / span
        return out

    def to_trace(self):
        """A predicted Trace in the measured traces' format, op for op: each subgraph's slot shared among its
        template ops in program order, in proportion to their modelled times (FLOPs for a measured cost model),
        with the same names, kinds and groups as the agent's events (events marked modelled/predicted)."""
        from ..trace import Trace

        ops_of = self.graph.ops_of()
        op_time = getattr(self.cost_model, "op_time_us", None)
        events = []
        for n, (lane, s, e) in sorted(self.slots.items(), key=lambda kv: kv[1][1]):
            ops = ops_of.get(n, [])
            w = [max(op_time(op, lane) if op_time else op["cost"][1], 1e-9) for op in ops]
            t, total = s, sum(w) or 1.0
            for op, wi in zip(ops, w):
                d = (e - s) * wi / total
                deps = sorted({r["op"] for r in op["inputs"] if isinstance(r, dict) and "op" in r})
                events.append({"name": op["name"], "kind": op["kind"], "lane": lane, "layer": op["layer"],
                               "chunk": op["chunk"], "group": n, "start_us": t, "end_us": t + d,
                               "bytes_in": 0, "bytes_out": 4 * op["shape"][0] * op["shape"][1], "flops": op["cost"][1],
                               "emulated": False, "modelled": self.cost_model.modelled, "predicted": True, "deps": deps,
                               "shape": list(op["shape"])})
                t += d
        how = "modelled" if self.cost_model.modelled else "fitted to agent measurements"
        # "profile" is the meta field's first name (saved traces carry it); "cost_model" says the same
        return Trace(events, {"title": f"predicted: {self.scheduler} on {self.cost_model.name} ({how})",
                              "modelled": self.cost_model.modelled, "predicted": True,
                              "cost_model": self.cost_model.name, "profile": self.cost_model.name,
                              "scheduler": self.scheduler})

    def check(self) -> None:
        """Raise if a dependency or the one-subgraph-per-lane rule is violated (used by tests)."""
        g = self.graph.by_name()
        for n, (lane, s, e) in self.slots.items():
            for d in g[n].deps:
                if self.slots[d][2] > s + 1e-6:
                    raise AssertionError(f"{n} starts at {s:.1f} before its dependency {d} ends at "
                                         f"{self.slots[d][2]:.1f}")
        by_lane: dict = {}
        for n, (lane, s, e) in self.slots.items():
            by_lane.setdefault(lane, []).append((s, e, n))
        for lane, iv in by_lane.items():
            iv.sort()
            for (s1, e1, n1), (s2, e2, n2) in zip(iv, iv[1:]):
                if s2 < e1 - 1e-6:
                    raise AssertionError(f"{n1} and {n2} overlap on lane {lane}")


def _prep(graph: ChunkGraph, cost_model: CostModel):
    subs = graph.subgraphs
    names = [g.name for g in subs]
    index = {n: i for i, n in enumerate(names)}
    dur = [cost_model.time_us(g) for g in subs]
    lanes = [g.lane for g in subs]
    deps = [[index[d] for d in g.deps] for g in subs]
    succ = [[] for _ in subs]
    for i, ds in enumerate(deps):
        for d in ds:
            succ[d].append(i)
    order = sorted(range(len(subs)), key=lambda i: (subs[i].chunk, subs[i].layer, STAGES.index(subs[i].stage)))
    rank = {i: r for r, i in enumerate(order)}
    return names, dur, lanes, deps, succ, order, rank


def _ready_time(i, deps, end, lanes, sync):
    t = 0.0
    for d in deps[i]:
        t = max(t, end[d] + (sync if lanes[d] != lanes[i] else 0.0))
    return t


def _list_schedule(graph, cost_model, pick) -> tuple[dict, int, float]:
    """Event-driven list scheduling: when a lane is free, `pick(lane, ready)` chooses what it runs next."""
    names, dur, lanes, deps, succ, order, rank = _prep(graph, cost_model)
    n = len(names)
    missing = [len(d) for d in deps]
    end = [0.0] * n
    lane_free = {l: 0.0 for l in set(lanes)}
    ready = {l: [] for l in lane_free}   # subgraphs whose dependencies are all done
    for i in range(n):
        if missing[i] == 0:
            ready[lanes[i]].append(i)
    running: list = []                  # heap of (end time, subgraph)
    done, t, decisions, dec_time = 0, 0.0, 0, 0.0
    slots = {}
    while done < n:
        started = False
        for lane in lane_free:
            if lane_free[lane] <= t and ready[lane]:
                cands = [i for i in ready[lane] if _ready_time(i, deps, end, lanes, cost_model.sync_us) <= t]
                if not cands:
                    continue
                t0 = time.perf_counter()
                i = pick(lane, cands, (names, dur, lanes, deps, succ, order, rank, missing))
                dec_time += time.perf_counter() - t0
                decisions += 1
                if i is None:
                    continue
                ready[lane].remove(i)
                s = t
                end[i] = s + dur[i]
                lane_free[lane] = end[i]
                slots[names[i]] = (lane, s, end[i])
                heapq.heappush(running, (end[i], i))
                started = True
        if started:
            continue
        # advance time to the next event: a subgraph ending or a sync delay expiring
        nxt = [e for e, _ in running[:1]]
        for lane in lane_free:
            for i in ready[lane]:
                rt = _ready_time(i, deps, end, lanes, cost_model.sync_us)
                if rt > t:
                    nxt.append(rt)
            if ready[lane] and lane_free[lane] > t:
                nxt.append(lane_free[lane])
        if not nxt:
            raise ScheduleError("the schedule cannot progress (a dependency cycle or a lane that never frees)")
        t = min(nxt)
        while running and running[0][0] <= t:
            _, i = heapq.heappop(running)
            done += 1
            for s_ in succ[i]:
                missing[s_] -= 1
                if missing[s_] == 0:
                    ready[lanes[s_]].append(s_)
    return slots, decisions, dec_time


def in_order(graph: ChunkGraph, cost_model: CostModel) -> Schedule:
    """Each lane runs its own subgraphs strictly in program order (waiting when the next is not ready)."""
    names, dur, lanes, deps, succ, order, rank = _prep(graph, cost_model)
    queues: dict = {}
    for i in order:
        queues.setdefault(lanes[i], []).append(i)
    pos = {l: 0 for l in queues}

    def pick(lane, cands, ctx):
        q = queues[lane]
        head = q[pos[lane]] if pos[lane] < len(q) else None
        if head in cands:
            pos[lane] += 1
            return head
        return None

    slots, dec, dt = _list_schedule(graph, cost_model, pick)
    return Schedule("in-order", graph, cost_model, slots, dt / max(dec, 1) * 1e6, dec)


def out_of_order(graph: ChunkGraph, cost_model: CostModel) -> Schedule:
    """mllm-NPU's online heuristic (eq. 6)."""
    def pick(lane, cands, ctx):
        names, dur, lanes, deps, succ, order, rank, missing = ctx
        best, best_key = None, None
        for i in cands:
            c = 0.0
            for s in succ[i]:
                if missing[s] == 1:  # i is its last unfinished dependency: s becomes ready
                    if lanes[i] != "npu" and lanes[s] == "npu":
                        c += dur[s]
                    elif lanes[i] == "npu" and lanes[s] != "npu":
                        c -= dur[s]
            key = (c, -rank[i])
            if best_key is None or key > best_key:
                best, best_key = i, key
        return best

    slots, dec, dt = _list_schedule(graph, cost_model, pick)
    return Schedule("ooo", graph, cost_model, slots, dt / max(dec, 1) * 1e6, dec)


def exact(graph: ChunkGraph, cost_model: CostModel, max_subgraphs: int = MAX_EXACT) -> Schedule:
    """Minimum makespan by branch and bound (small instances only)."""
    names, dur, lanes, deps, succ, order, rank = _prep(graph, cost_model)
    n = len(names)
    if n > max_subgraphs:
        raise ScheduleError(f"the exact scheduler handles at most {max_subgraphs} subgraphs; this graph has {n} "
                            "(use a shorter prompt, fewer layers, or the ooo heuristic)")
    sync = cost_model.sync_us
    lane_work = {l: sum(dur[i] for i in range(n) if lanes[i] == l) for l in set(lanes)}
    best = {"mk": float("inf"), "slots": None}
    end = [0.0] * n
    start = [0.0] * n

    def dfs(placed: int, mask: int, lane_free: dict, left: dict, mk: float):
        if placed == n:
            if mk < best["mk"] - 1e-9:
                best["mk"] = mk
                best["slots"] = {names[i]: (lanes[i], start[i], end[i]) for i in range(n)}
            return
        # lower bound: a lane cannot finish before its free time plus its remaining work
        if max(max(lane_free[l] + left[l] for l in left), mk) >= best["mk"] - 1e-9:
            return
        for i in sorted(range(n), key=lambda j: rank[j]):
            if mask >> i & 1 or any(not (mask >> d & 1) for d in deps[i]):
                continue
            l = lanes[i]
            s = max([lane_free[l]] + [end[d] + (sync if lanes[d] != l else 0.0) for d in deps[i]])
            start[i], end[i] = s, s + dur[i]
            old = lane_free[l]
            lane_free[l] = end[i]
            left[l] -= dur[i]
            dfs(placed + 1, mask | 1 << i, lane_free, left, max(mk, end[i]))
            left[l] += dur[i]
            lane_free[l] = old

    dfs(0, 0, {l: 0.0 for l in lane_work}, dict(lane_work), 0.0)
    return Schedule("exact", graph, cost_model, best["slots"])


def schedule(graph: ChunkGraph, cost_model: CostModel, scheduler: str = "ooo") -> Schedule:
    fns = {"in-order": in_order, "ooo": out_of_order, "exact": exact}
    if scheduler not in fns:
        raise ScheduleError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(fns)}")
    return fns[scheduler](graph, cost_model)

"""Run a Plan — a DAG of named ops over lanes — with one worker thread per lane, and trace every op.

A plan (pure data, msgpack-able):
    {"ops": [{"name": str, "kind": op kind (ops.OPS), "lane": "cpu" | "npu" | "gpu",
              "inputs": [{"blob": sha256} | {"op": name} | {"input": key}, ...],
              "deps": [names that must finish first, besides the ops named in inputs],
              "attrs": {...}, "layer": int, "chunk": int}, ...],
     "lane_order": {lane: [names in the order that lane runs them]},   # default: plan order
     "outputs": [names]}
Lanes stand for processors: each runs its ops one at a time, in its order; ops on different lanes
overlap wherever dependencies allow (kernels release the GIL). Ops on `npu` run NPU kernels on this
machine: with the numba backend NPU-semantics kernels on the CPU (events say emulated "semantics"), with the
hvx backend Hexagon machine code under qemu-hexagon (emulated "isa", with the DSP's packet counts).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from errno import EMFILE

from edgeprobe_kernels.numerics import CaptureError

from .ops import GATHERS_ROWS, OPS, OpError, RunnerCache, bytes_in, check_fused, flops, runs_beside
from .protocol import AgentError, leaf_names
from .store import now_us
from .threads import CORES_IN_USE

LANES = ("cpu", "npu", "gpu")
# a phone's NPU cannot run here: what its events' time is unless the op says more (the hvx backend says "isa")
EMULATED_LANES = {"npu": "semantics"}


class PlanError(AgentError):
    """A plan the agent refuses before running anything."""


class Cancelled(Exception):
    pass


@dataclass
class Plan:
    ops: dict            # name -> op dict
    order: list          # names in plan order
    lane_order: dict     # lane -> [names]
    outputs: list
    parents: dict        # name -> set of names it waits for
    deps: dict = field(default_factory=dict)    # name -> sorted parents (what its trace event lists)
    waits: dict = field(default_factory=dict)   # name -> parents on other lanes (the only ones to wait for)
    signals: set = field(default_factory=set)   # ops another lane waits for (the only ones that need an Event)
    steps: dict = field(default_factory=dict)   # name -> what running it needs, parsed once (see __post_init__)
    readers: dict = field(default_factory=dict)  # name -> how many input references of other ops read its output
    registry: dict | None = None  # op kind -> fn, over OPS (a host running the template's float ops, with its hooks)

    def __post_init__(self):
        lane = {n: self.ops[n]["lane"] for n in self.order}
        registry = self.registry or OPS
        self.deps = {n: sorted(self.parents[n]) for n in self.order}
        # a lane runs in order, so a parent on the same lane placed earlier is done already; one placed later
        # would be a cycle, which validate refuses
        self.waits = {n: [p for p in self.deps[n] if lane[p] != lane[n]] for n in self.order}
        self.signals = {p for n in self.order for p in self.waits[n]}
        # per op, parsed once: a decode step runs ~33 ops, each costing tens of us of Python beside its kernel
        # (kind, its function, attrs, inputs as (source, key) pairs, the input it gathers rows from, its trace
        # event's fixed fields, the other lanes' ops it waits for, the op outputs it reads, whether it runs beside
        # another lane's op without taking its cores)
        for n in self.order:
            op = self.ops[n]
            for r in op.get("inputs", []):
                if "op" in r:
                    self.readers[r["op"]] = self.readers.get(r["op"], 0) + 1
            refs = [next(iter(r.items())) for r in op.get("inputs", [])]
            self.steps[n] = (op["kind"], registry[op["kind"]], op.get("attrs", {}), refs, _gathered(op),
                             {"name": n, "kind": op["kind"], "lane": lane[n], "layer": op.get("layer", -1),
                              "chunk": op.get("chunk", 0), "deps": self.deps[n], "group": op.get("group", n)},
                             self.waits[n], [key for src, key in refs if src == "op"],
                             runs_beside(op["kind"], op.get("attrs", {})))


def _gathered(op: dict) -> frozenset:
    """The indices of op's inputs it gathers a few rows from (ops.GATHERS_ROWS), a fused op's through its sub-ops
    (a decode step op's embedding table): a blob there is mapped, not read whole."""
    if op["kind"] != "fused":
        i = GATHERS_ROWS.get(op["kind"])
        return frozenset() if i is None else frozenset([i])
    out = set()
    for sub in op.get("attrs", {}).get("ops", []):
        if sub["kind"] == "fused":
            continue  # a layer's ops read its own inputs, never a gathered table
        i = GATHERS_ROWS.get(sub["kind"])
        ins = sub.get("inputs", [])
        if i is not None and i < len(ins) and "arg" in ins[i]:
            out.add(ins[i]["arg"])
    return frozenset(out)


def validate(plan, has_blob, lanes=LANES, registry: dict | None = None) -> Plan:
    """Check a plan fully before running anything: kinds, lanes, references, blobs, cycles, lane orders.
    registry: op kind -> fn to run instead of OPS (the host's float pass: its linears, LM head and hooks)."""
    kinds = registry or OPS
    if not isinstance(plan, dict) or not isinstance(plan.get("ops"), list) or not plan["ops"]:
        raise PlanError("bad_plan", "a plan is a map with a non-empty list 'ops'")
    ops, order = {}, []
    for i, op in enumerate(plan["ops"]):
        if not isinstance(op, dict) or not isinstance(op.get("name"), str):
            raise PlanError("bad_plan", f"op #{i} needs a string 'name'")
        name = op["name"]
        if name in ops:
            raise PlanError("bad_plan", f"op name {name!r} is used twice")
        if op.get("kind") not in kinds:
            raise PlanError("unknown_op", f"op {name!r} has unknown kind {str(op.get('kind'))[:40]!r}; "
                                          f"this agent runs {', '.join(sorted(kinds))}")
        if op.get("lane") not in lanes:
            raise PlanError("unknown_lane", f"op {name!r} asks for lane {str(op.get('lane'))[:20]!r}; this agent "
                                            f"has lanes {', '.join(lanes)}")
        if not isinstance(op.get("inputs", []), list) or not isinstance(op.get("deps", []), list) \
                or not isinstance(op.get("attrs", {}), dict):
            raise PlanError("bad_plan", f"op {name!r}: inputs and deps must be lists, attrs a map")
        if op["kind"] == "fused":
            check_fused(name, op.get("attrs", {}), len(op.get("inputs", [])))
        ops[name] = op
        order.append(name)
    parents = {}
    for name in order:
        op, ps = ops[name], set()
        for ref in op.get("inputs", []):
            if not isinstance(ref, dict) or len(ref) != 1:
                raise PlanError("bad_plan", f"op {name!r}: input {str(ref)[:60]} must be one of "
                                            "{'blob': sha}, {'op': name}, {'input': key}")
            (k, v), = ref.items()
            if k == "op":
                if v not in ops:
                    raise PlanError("unknown_ref",
                                    f"op {name!r} reads the output of {str(v)[:40]!r}, which is not in the plan")
                ps.add(v)
            elif k == "blob":
                if not has_blob(v):
                    raise PlanError("missing_blob", f"op {name!r} needs blob {str(v)[:16]}, which the agent does not "
                                                    "hold; upload it (has_blobs / put_blob) first")
            elif k != "input":
                raise PlanError("bad_plan", f"op {name!r}: unknown input reference {k!r}")
        for d in op.get("deps", []):
            if d not in ops:
                raise PlanError("unknown_ref", f"op {name!r} depends on {str(d)[:40]!r}, which is not in the plan")
            ps.add(d)
        parents[name] = ps
    lane_order = plan.get("lane_order") or {}
    if not isinstance(lane_order, dict):
        raise PlanError("bad_plan", "lane_order must map lanes to lists of op names")
    lo = {lane: [n for n in order if ops[n]["lane"] == lane] for lane in lanes}
    for lane, names in lane_order.items():
        if lane not in lanes or not isinstance(names, list) or sorted(map(str, names)) != sorted(lo[lane]):
            raise PlanError("bad_plan", f"lane_order[{str(lane)[:20]!r}] must list exactly the ops on that lane")
        lo[lane] = list(names)
    # a lane runs its ops in order, so "previous op on the lane" is an edge too; a cycle means deadlock
    edges = {n: set(parents[n]) for n in order}
    for names in lo.values():
        for a, b in zip(names, names[1:]):
            edges[b].add(a)
    _check_acyclic(edges)
    outputs = plan.get("outputs") or [order[-1]]
    if not isinstance(outputs, list) or any(o not in ops for o in outputs):
        raise PlanError("unknown_ref", "outputs must name ops of the plan")
    return Plan(ops, order, lo, outputs, parents, registry=registry)


def _check_acyclic(edges: dict) -> None:
    state = {}
    for start in edges:
        if state.get(start):
            continue
        stack = [(start, iter(edges[start]))]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                raise PlanError("cycle", f"the plan has a dependency cycle (through {nxt!r}), counting each lane's "
                                         "order; it would deadlock")
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(edges[nxt])))


@dataclass
class Context:
    """What a run's ops may reach. One Context per run: its counters (and the reads get / read_rows /
    read_blob report) belong to that run alone; runners is the cache shared across runs."""
    get: object                      # sha -> array
    counters: dict = field(default_factory=dict)
    runners: RunnerCache = field(default_factory=RunnerCache)
    lane: str = "cpu"                # which processor the op runs on (ops pick their kernels by it)
    session: object = None           # the run's decode session (KV cache kept on the agent), if any
    offset: int = 0                  # positions past the session's length where this pass starts (a decode loop's step)
    read_rows: object = None         # (sha, rows, lane=) -> rows of a blob read from flash, not kept resident
    read_blob: object = None         # sha -> a whole blob read from flash, not kept resident
    map_blob: object = None          # sha -> the blob memory-mapped: rows paged in from flash when touched
    blob_meta: object = None         # sha -> {"dtype", "shape"} of a blob, nothing read (FlashStore.meta)
    layout: object = None            # (sha, tag, shape, dtype, make, empty=, into=) -> the blob in a kernel's
                                     # layout (FlashStore.layout)
    backends: dict = field(default_factory=dict)  # lane -> kernel backend chosen for it ("npu": "numba" | "hvx")
    kernels: dict = field(default_factory=dict)   # lane -> what computes there (backends.lane_kernels): "backend"
    emulated: dict = field(default_factory=lambda: dict(EMULATED_LANES))  # lane -> what its events' time is, by default
    event: dict | None = None        # fields the running op adds to its trace event (isa, emulated, DSP counts)
    sub_event: dict | None = None    # what each sub-op event of the running step op starts from (lane, chunk, ...)
    blob_args: dict | None = None    # op name -> its inputs' resolved blobs (None elsewhere), kept for one run: a
                                     # decode loop's steps resolve a step op's ~65 blobs once; set only where get
                                     # is the run's own cache (its arrays never change within the run)
    numerics: object = None          # the run's numerics capture (edgeprobe_kernels.numerics.Capture), if asked
    captured: list | None = None     # the capture events of a fused op's sub-ops (ops.fused), taken by the executor


def run_untraced(plan: Plan, inputs: dict, ctx: Context) -> dict:
    """Run a plan whose ops all sit on one lane on the calling thread, in that lane's order, with no trace and no
    core counting: the host's in-process float pass (edgeprobe.graph.local), whose per-op Python is its decode
    step's overhead. The same Plan, registry and op functions as execute; returns {output name: array}."""
    (lane, names), = [(lane, names) for lane, names in plan.lane_order.items() if names]
    results: dict = {}
    run_ops(plan, names, inputs, replace(ctx, lane=lane), results, dict(plan.readers))
    return {n: results[n] for n in plan.outputs}


def run_ops(plan: Plan, names, inputs: dict, ctx: Context, results: dict, unread: dict) -> None:
    """run_untraced's loop over some of a plan's ops (`names`, in order) into `results` {op: array}: an output no
    later op reads (`unread`: the plan's readers count, updated here) is dropped as it goes. A plan run in parts
    (the host's layer-major pass: one layer's ops for every window in turn) keeps one results and unread a window."""
    keep, steps = set(plan.outputs), plan.steps
    for name in names:
        kind, fn, attrs, refs, _, _, _, reads, _ = steps[name]
        args = [results[key] if src == "op" else ctx.get(key) if src == "blob" else inputs[key] for src, key in refs]
        try:
            out = fn(args, attrs, ctx)
        except AgentError:
            raise
        except Exception as e:  # as execute reports it
            raise OpError("op_failed", f"op {name!r} ({kind}) failed: {type(e).__name__}: {e}") from None
        results[name] = out
        for key in reads:
            unread[key] -= 1
            if not unread[key] and key not in keep:
                del results[key]


def capture_names(plan: Plan) -> list:
    """The op names a numerics capture picks from, in plan order: a plan op's, or a fused op's sub-ops' in its place
    (a decode step's one op `step` -> embed, blk.0.attn_norm, ..., lm_head: the template's names, as the host's)."""
    return leaf_names(plan.ops[n] for n in plan.order)


def _capture(capture, name: str, out, fixed: dict):
    """The numerics capture of op `name`'s output on its lane -> (the output, its "numerics:<op>" trace event)."""
    t0 = now_us()
    try:
        out = capture.take(name, out)
    except CaptureError as e:  # a full tensor over the limit
        raise AgentError(e.code, str(e)) from None
    return out, {"name": f"numerics:{name}", "kind": "numerics", "lane": fixed["lane"], "layer": fixed["layer"],
                 "chunk": fixed["chunk"], "deps": [name], "group": f"numerics:{fixed['group']}", "start_us": t0,
                 "end_us": now_us(), "bytes_in": int(out.nbytes), "bytes_out": 0, "flops": 0, "emulated": False}


class _Signal:
    """One op's end, for the ops of other lanes that wait for it: a lock held until set, which each waiter takes
    and hands straight back. threading.Event's set and wait run a Condition's Python (a new lock for every wait);
    a hand-off pays set on the producing lane and wait on the consuming one, both on the run's critical path."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """True once set (then at once, every time); False after `timeout` seconds unset."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True


def execute(plan: Plan, inputs: dict, ctx: Context, cancel: threading.Event | None = None,
            on_op=None) -> tuple[dict, list]:
    """Run `plan` with one thread per lane. Returns ({output name: array}, trace events).

    on_op(event) is called after each op (progress), under the run's lock: one call at a time. Raises AgentError
    (OpError, StoreError, ...) / Cancelled. Each lane counts into its own dict (one owner per dict); they are added
    into ctx.counters after the join. A plan on one lane (a decode step) takes its cores once for the whole pass
    (threads.Cores.enter), not per op: its ops run back to back on one thread, and a decode step paid ~4 us an op
    for the count's lock and numba's per-thread setting, with the caches swept by the weights.
    """
    cancel = cancel or threading.Event()
    done = {n: _Signal() for n in plan.signals}  # one per cross-lane hand-off, not per op
    results: dict = {}
    # an output no later op reads is dropped (under lock): a 256-token prefill kept all 528 outputs, ~400 MB, to
    # the end of the run, faulting in fresh heap pages for every op of a new agent's first run (a phone has less)
    unread = dict(plan.readers)
    keep = set(plan.outputs)
    events: list = []
    failure: list = []
    lock = threading.Lock()
    lane_counters = {lane: {} for lane in plan.lane_order}

    def resolve(src, key, rows_only: bool):
        if src == "blob":
            return ctx.map_blob(key) if rows_only and ctx.map_blob is not None else ctx.get(key)  # ops.GATHERS_ROWS
        if key not in inputs:
            raise OpError("missing_input", f"the plan reads run input {str(key)[:40]!r}, which the run did not send")
        return inputs[key]

    def lane_worker(lane, names, solo=False):
        lane_ctx = replace(ctx, lane=lane, counters=lane_counters[lane])  # shares the runner cache
        blob_args = ctx.blob_args
        backend = {"backend": ctx.kernels[lane]} if lane in ctx.kernels else {}
        emulated = ctx.emulated.get(lane, False)
        steps, enter, leave = plan.steps, CORES_IN_USE.enter, CORES_IN_USE.leave
        capture = ctx.numerics
        if capture is not None:  # a fused op's sub-op captures land here (ops.fused) and join the events below
            lane_ctx.captured = []
        if solo:  # the pass's one count of cores (see the docstring): its ops' enter / leave do nothing
            solo_threads = enter()
            enter, leave = (lambda side: solo_threads), (lambda side: None)
        try:
            if not solo:
                CORES_IN_USE.lanes_started()  # threads.Cores.lanes_started: no lane's team spins on the other's core
            for name in names:
                # the Python between two ops is per-token time a decode step pays ~33 times (22 us an op here
                # with the caches swept by the weights): locals, no per-op lookups the plan made once
                kind, fn, attrs, refs, gathered, fixed, waits, reads, side = steps[name]
                for p in waits:
                    while not done[p].wait(0.05):
                        if cancel.is_set() or failure:
                            raise Cancelled()
                if cancel.is_set() or failure:
                    raise Cancelled()
                base = blob_args.get(name) if blob_args is not None else None
                if base is None:
                    args = [results[key] if src == "op" else resolve(src, key, i in gathered)
                            for i, (src, key) in enumerate(refs)]
                    if blob_args is not None:  # never an op's output: the executor drops those once read
                        blob_args[name] = [a if src == "blob" else None for (src, _), a in zip(refs, args)]
                else:
                    args = base[:]
                    for i, (src, key) in enumerate(refs):
                        if src != "blob":
                            args[i] = results[key] if src == "op" else resolve(src, key, False)
                event = lane_ctx.event = {}
                threads = enter(side)
                if kind == "fused":  # a step op's sub-op events start from these (ops._own_event)
                    lane_ctx.sub_event = {"lane": fixed["lane"], "chunk": fixed["chunk"], "emulated": emulated,
                                          **backend, **({"threads": threads} if threads else {})}
                t0 = now_us()
                try:
                    out = fn(args, attrs, lane_ctx)
                except (AgentError, Cancelled):
                    raise
                except Exception as e:  # a kernel failing on bad shapes must not kill the agent
                    hint = ("; every mapped blob and layout holds a descriptor: raise the agent's hard limit on open "
                            "files (ulimit -Hn) or restart it to drop earlier models") \
                        if getattr(e, "errno", 0) == EMFILE else ""
                    raise OpError("op_failed", f"op {name!r} ({kind}) failed: {type(e).__name__}: {e}{hint}") from None
                finally:
                    t1 = now_us()
                    leave(side)
                cap_ev, sub_caps = None, None
                if capture is not None:
                    if name in capture.ops:  # its own event: timelines with it never pass for plain
                        out, cap_ev = _capture(capture, name, out, fixed)
                    elif lane_ctx.captured:
                        sub_caps, lane_ctx.captured = lane_ctx.captured, []
                # the output first, then the waiting lane's signal, then this op's event: the other lane's op
                # starts while this thread writes the event (a 64-token prefill ~5% faster; docs/benchmarks.md)
                with lock:
                    results[name] = out
                    for key in reads:
                        unread[key] -= 1
                        if not unread[key] and key not in keep:
                            del results[key]
                if name in done:
                    done[name].set()
                subs = event.pop("sub_events", None) if event else None
                if subs:  # a step op: its sub-ops' events (ops.op_fused, from lane_ctx.sub_event) in place of its own
                    ev = subs[-1]
                else:
                    ev = {**fixed, "start_us": t0, "end_us": t1, "bytes_in": bytes_in(args), "bytes_out": out.nbytes,
                          "flops": int(flops(kind, args, out, attrs, lane_ctx)), "emulated": emulated,
                          "shape": list(out.shape), **backend}
                    if threads:
                        ev["threads"] = threads
                    if event:
                        ev.update(event)  # the op's own fields (emulated among them) win
                with lock:
                    if subs:
                        events.extend(subs)
                    else:
                        events.append(ev)
                    if cap_ev is not None:
                        events.append(cap_ev)
                    if sub_caps:
                        events.extend(sub_caps)
                    if on_op:
                        on_op(ev)
        except BaseException as e:
            with lock:
                failure.append(e)
        finally:
            if solo:
                CORES_IN_USE.leave()

    busy = [(lane, names) for lane, names in plan.lane_order.items() if names]
    if len(busy) == 1:  # one lane (a decode step): run it on this thread, no thread to start and join
        lane_worker(*busy[0], solo=True)
    else:
        threads = [threading.Thread(target=lane_worker, args=(lane, names), name=f"lane-{lane}", daemon=True)
                   for lane, names in busy]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for counts in lane_counters.values():
        for k, v in counts.items():
            ctx.counters[k] = ctx.counters.get(k, 0) + v
    if failure:
        real = [f for f in failure if not isinstance(f, Cancelled)]
        raise (real[0] if real else Cancelled())
    return {n: results[n] for n in plan.outputs}, sorted(events, key=lambda e: e["start_us"])

"""`edgeprobe run`: a quantized prefill (or decode) on one device agent, or on several at once, and its trace."""
from __future__ import annotations

import json
import sys
import time

from ..errors import EdgeprobeError
from .common import prepared_model, say_for

CHUNKED = ("in-order", "ooo")  # the schedulers that cut the prompt into --chunk tokens
DEFAULT_CHUNK = 256
SCHEDULER_WHOLE = {"layer": "prefills the whole prompt layer by layer",
                   "hetero": "splits each matmul between lanes over the whole prompt"}


def cmd_run(args) -> int:
    from .. import models
    from ..corpus import corpus_path, read_text_file
    from ..device import check_device_spec
    from ..quant.qmodel import check_scheme

    check_scheme(args.scheme)
    specs = args.device or ["local"]
    for spec in specs:
        try:
            check_device_spec(spec)
        except ValueError as e:
            print(f"edgeprobe: error: {e}", file=sys.stderr)
            return 2
    chunked = args.scheduler in CHUNKED
    if not chunked and args.chunk is not None:
        print(f"edgeprobe: error: --chunk applies to the chunked prefill (--scheduler in-order or ooo); --scheduler "
              f"{args.scheduler} {SCHEDULER_WHOLE[args.scheduler]}: add --scheduler ooo or drop --chunk",
              file=sys.stderr)
        return 2
    if args.chunk is None:
        args.chunk = DEFAULT_CHUNK
    if chunked and args.chunk < 1:
        print(f"edgeprobe: error: --chunk must be a positive number of tokens, got {args.chunk}", file=sys.stderr)
        return 2
    if args.prompt_len is not None and args.prompt_len < 1:
        print("edgeprobe: error: --prompt-len must be at least 1", file=sys.stderr)
        return 2
    if args.decode is not None and (args.decode < 1 or args.batch < 1):
        print("edgeprobe: error: --decode and --batch must be at least 1", file=sys.stderr)
        return 2
    if args.decode is None and args.batch != 1:
        print("edgeprobe: error: --batch applies to decoding; add --decode N", file=sys.stderr)
        return 2
    if args.decode_loop == "agent" and (args.decode is None or args.temperature > 0):
        print("edgeprobe: error: --decode-loop agent is a greedy loop of --decode N steps; give --decode N and leave "
              "--temperature at 0", file=sys.stderr)
        return 2
    if args.decode is not None and args.scheduler != "layer":
        print("edgeprobe: error: --decode prefills layer by layer inside its decode session; leave --scheduler at "
              "layer", file=sys.stderr)
        return 2
    if args.store is not None and any(s not in ("local", "arm64", "aarch64") for s in specs):
        other = next(s for s in specs if s not in ("local", "arm64", "aarch64"))
        print(f"edgeprobe: error: --store is the local agent's flash; --device {other} keeps its own store "
              "(start that agent with `edgeprobe agent --store DIR`)", file=sys.stderr)
        return 2
    if len(specs) > 1 and args.store is not None:
        print("edgeprobe: error: --store is one agent's flash; with several --device each local agent picks a store of "
              "its own (and says which)", file=sys.stderr)
        return 2
    why = _numerics_refusal(args, specs)
    if why:
        print(f"edgeprobe: error: {why}", file=sys.stderr)
        return 2
    if len(specs) > 1 and args.decode is not None:
        print("edgeprobe: error: --decode runs on one device; give one --device (several run one prefill and compare)",
              file=sys.stderr)
        return 2
    say = say_for(args)
    model = models.load(args.model)
    ids = model.tokenizer.encode(read_text_file(args.prompt_file or corpus_path("heldout")))
    if not len(ids):
        print(f"edgeprobe: error: the prompt file {args.prompt_file} holds no tokens; give it some text",
              file=sys.stderr)
        return 2
    n = args.prompt_len or min(len(ids), 256)
    if len(ids) < n:  # a short prompt file is a prompt, not a mistake: run all of it
        say(f"the prompt has {len(ids)} tokens, fewer than --prompt-len {n}: prefilling all {len(ids)}")
        n = len(ids)
    if n + (args.decode or 0) > model.config.context_length:
        print(f"edgeprobe: error: --prompt-len {n}{f' + --decode {args.decode}' if args.decode else ''} exceeds the "
              f"context length {model.config.context_length}", file=sys.stderr)
        return 2
    if chunked and args.chunk > n:  # one chunk holding the whole prompt: the schedule a longer chunk would give
        say(f"--chunk {args.chunk} is longer than the {n}-token prompt: prefilling it as one chunk of {n} tokens")
        args.chunk = n
    tokens = ids[:n]
    if args.numerics and args.numerics_ops is not None and \
            not _numerics_ops_exist(model, n, args.numerics_ops, args.chunk if chunked else None):
        print(f"edgeprobe: error: --numerics-ops {args.numerics_ops!r} names no op of the plan (ops are named like "
              "'embed', 'blk.1.attn_q', 'blk.1.*', 'lm_head')", file=sys.stderr)
        return 2
    if len(specs) > 1:
        return _run_farm(args, specs, model, ids, tokens, say)
    args.device = specs[0]  # one device: its JSON names it as a string, as ever
    return _run_one(args, model, ids, tokens, say)


def _agent_refusal(args, dev, name: str) -> str | None:
    """Why this agent cannot run what the command line asks (npu backend, lanes), before minutes of quantizing."""
    chosen = (dev.info.get("backends") or {}).get("npu", {}).get("chosen", "numba")
    if chosen != args.npu_backend:
        return f"the agent at {name} runs the npu lane on {chosen}; start it with --npu-backend {args.npu_backend}"
    need = {"hetero": {"npu", "gpu"}, "in-order": {"npu", "cpu"}, "ooo": {"npu", "cpu"}}.get(args.scheduler, set())
    lacking = sorted(need - set(dev.info.get("lanes", [])))
    if lacking:
        why = (dev.info.get("lanes_missing") or {}).get("gpu") or "the gpu lane needs OpenCL (Debian pocl-opencl-icd)"
        return (f"--scheduler {args.scheduler} puts work on lanes {lacking} that this agent lacks (it has "
                f"{dev.info.get('lanes')}){f'; gpu: {why}' if 'gpu' in lacking else ''}")
    return None


def _upload(dev, qm, progress: bool, say, prefix: str = "") -> int:
    """Upload what the agent lacks and say it in one line -> bytes sent."""
    t0 = time.perf_counter()
    sent = dev.upload(qm, progress=progress)  # the workflows upload too; then nothing is missing
    where = f" ({dev.store})" if dev.store else ""
    say(f"{prefix}uploaded {sent / 1e6:.1f} MB to the agent in {time.perf_counter() - t0:.1f} s" if sent else
        f"{prefix}the agent{where} already holds all {len(qm.manifest['blobs'])} blobs of this model: nothing to "
        "upload")
    return sent


def _numba_reference(args, qm, tokens, ids, progress: bool):
    """The same plan on a local agent's numba kernels -> (its RunResult, its numba version; None: none here either)."""
    from ..device import Device

    with Device.local(npu_backend="numba") as ref_dev:
        ref, _ = _prefill(args, ref_dev, qm, tokens, ids, progress)
        return ref, ref_dev.info.get("numba")


def _run_fields(args, device: str, res, extra: dict, upload: int, info: dict, host, n: int) -> dict:
    """run's JSON object for one device's prefill (a contract: extend, never rename)."""
    import numpy as np

    from ..trace import cosine

    m = res.trace.metrics()
    out = {"model": args.model, "scheme": args.scheme, "device": device, "tokens": int(n),
           "tok_per_s": n / (m["makespan_ms"] / 1e3), "wall_tok_per_s": n / res.wall_s, "makespan_ms": m["makespan_ms"],
           "lanes": {k: round(v["busy_pct"], 2) for k, v in m["lanes"].items()},
           "bubbles": {k: v["bubbles"] for k, v in m["lanes"].items()}, "upload_bytes": int(upload),
           "logits_cosine_vs_host": cosine(res.logits[-1], np.asarray(host)), "counters": res.counters,
           "agent": {k: info.get(k) for k in ("agent_version", "lanes", "emulated_lanes", "cores", "cpu", "backends")},
           **_agent_fields(info), "trace": args.trace, "scheduler": args.scheduler,
           "chunk": args.chunk if args.scheduler in ("in-order", "ooo") else None,
           "predicted_makespan_ms": res.trace.meta.get("predicted_makespan_ms"), **extra}
    if out["predicted_makespan_ms"]:  # the cost model's error, beside the measurement
        out["predicted_over_measured"] = out["predicted_makespan_ms"] / m["makespan_ms"]
    return out


def _reference_fields(args, res, info: dict, ref) -> dict:
    """Beside an agent without numba, or on hvx: how far its logits are from the numba reference's."""
    import numpy as np

    if args.npu_backend == "numba" and info.get("numba"):
        return {}
    from ..trace import cosine

    ref_res, ref_numba = ref
    return {"numba_reference_numba": ref_numba,
            "logits_max_abs_diff_vs_numba": float(np.abs(res.logits.astype(np.float64) - ref_res.logits).max()),
            "logits_cosine_vs_numba": cosine(res.logits[-1], ref_res.logits[-1]),
            "top1_equals_numba": bool(np.argmax(res.logits[-1]) == np.argmax(ref_res.logits[-1])),
            "numba_reference_device": "local"}


def _run_one(args, model, ids, tokens, say) -> int:
    from ..device import open_device
    from ..numerics import NumericsError
    from ..schedule import ScheduleError
    from ..workflows import host_logits

    n, progress = len(tokens), not args.no_progress
    try:
        dev = open_device(args.device, args.ssh_key, args.known_hosts, store=args.store, npu_backend=args.npu_backend,
                          say=say)
    except (ValueError, EdgeprobeError) as e:  # a bad --device, or an arm64 device that is not built
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    refusal = _agent_refusal(args, dev, args.device)
    if refusal:
        dev.close()
        print(f"edgeprobe: error: {refusal}", file=sys.stderr)
        return 2
    try:
        qm = prepared_model(model, args.scheme, progress, say=say)
    except BaseException:
        dev.close()  # the agent must not wait out its heartbeat for a host that failed before using it
        raise
    with dev:
        before = dev.uploaded_bytes
        _upload(dev, qm, progress, say)
        try:
            if args.decode and args.numerics:
                return _decode_numerics(args, dev, qm, model, tokens, progress, before)
            if args.decode:
                return _run_decode(args, dev, qm, model, tokens, progress, before)
            if args.numerics:
                res, extra = _prefill_numerics(args, dev, qm, model, tokens, ids, progress)
            else:
                res, extra = _prefill(args, dev, qm, tokens, ids, progress)
        except (ScheduleError, NumericsError) as e:
            print(f"edgeprobe: error: {e}", file=sys.stderr)
            return 2
        upload = dev.uploaded_bytes - before
        info = dev.info
    if args.npu_backend != "numba" or not info.get("numba"):  # the same plan on a local agent's numba kernels
        extra.update(_reference_fields(args, res, info, _numba_reference(args, qm, tokens, ids, progress)))
    extra["npu_backend"] = args.npu_backend
    extra["npu_dsp"] = _dsp_totals(res.trace.events)
    host = host_logits(qm, tokens, args.chunk if args.scheduler in ("in-order", "ooo") else None)
    out = _run_fields(args, args.device, res, extra, upload, info, host, n)
    m = res.trace.metrics()
    if args.trace:
        res.trace.to_chrome_json(args.trace)
    if args.json:
        print(json.dumps(out))
    else:
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in out["lanes"].items())
        print(f"prefill {n} tokens on {args.device}: {out['tok_per_s']:.0f} tok/s, makespan {m['makespan_ms']:.1f} ms "
              f"(busy: {busy}); uploaded {upload / 1e6:.1f} MB; logits cosine vs host "
              f"{out['logits_cosine_vs_host']:.6f}")
        if out["predicted_makespan_ms"]:
            print(f"predicted makespan {out['predicted_makespan_ms']:.1f} ms = "
                  f"{out['predicted_over_measured']:.2f}x the measured "
                  f"({out.get('cost_model', args.cost_model)} cost model)")
        if out.get("numerics"):
            _say_numerics(out["numerics"])
        if out["npu_dsp"]:
            d = out["npu_dsp"]
            print(f"npu lane on {d['isa']} (qemu-hexagon): {d['hvx_packets']} packets, estimated "
                  f"{d['dsp_ms_estimate']:.2f} ms on a DSP at {d['dsp_clock_hz'] / 1e9:g} GHz; logits max |diff| "
                  "vs numba "
                  f"{out['logits_max_abs_diff_vs_numba']:.3g}")
    return 0


def _run_farm(args, specs, model, ids, tokens, say) -> int:
    """Several --device: one prefill on every agent at once (edgeprobe.farm), a comparison table, one Perfetto file
    with a process per device. Exit 1 when a device failed mid-run (its row says why), 2 when one cannot be used."""
    from ..device import open_device
    from ..farm import Farm
    from ..workflows import host_logits

    n, progress = len(tokens), not args.no_progress
    try:
        farm = Farm.open(specs, opener=lambda spec: open_device(spec, args.ssh_key, args.known_hosts,
                                                                npu_backend=args.npu_backend, say=say, progress=False))
    except EdgeprobeError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    with farm:
        refusals = [f"{name}: {why}" for name, dev in farm.devices.items() if (why := _agent_refusal(args, dev, name))]
        if refusals:
            print(f"edgeprobe: error: {'; '.join(refusals)}", file=sys.stderr)
            return 2
        qm = prepared_model(model, args.scheme, progress, say=say)
        names = {id(dev): name for name, dev in farm.devices.items()}

        def work(dev):  # on the device's own thread: nothing here is shared but the read-only qm and tokens
            _upload(dev, qm, False, say, prefix=f"{names[id(dev)]}: ")
            return _prefill(args, dev, qm, tokens, ids, False, per_device=True)

        say(f"running {n} tokens on {len(specs)} devices {'in turn' if args.sequential else 'at once'}: "
            f"{', '.join(farm.devices)}")
        result = farm.run(work, tokens=n, concurrent=not args.sequential)
    ok = [r for r in result.runs if r.ok]
    ref = None
    if any(args.npu_backend != "numba" or not r.info.get("numba") for r in ok):
        ref = _numba_reference(args, qm, tokens, ids, progress)
    host = host_logits(qm, tokens, args.chunk if args.scheduler in ("in-order", "ooo") else None)
    devices, rows = [], result.table()
    for r, row in zip(result.runs, rows):
        if not r.ok:
            devices.append({"device": r.device, "error": r.error})
            continue
        extra = {**r.extra, **_reference_fields(args, r.value, r.info, ref), "npu_backend": args.npu_backend,
                 "npu_dsp": _dsp_totals(r.value.trace.events)}
        devices.append(_run_fields(args, r.device, r.value, extra, r.upload_bytes, r.info, host, n))
        row["cosine_vs_host"] = devices[-1]["logits_cosine_vs_host"]
    if args.trace and ok:
        result.to_chrome_json(args.trace)
    if args.json:
        print(json.dumps({"model": args.model, "scheme": args.scheme, "tokens": int(n), "scheduler": args.scheduler,
                          "concurrent": not args.sequential, "devices": devices, "comparison": rows,
                          "trace": args.trace if ok else None}, default=float))
    else:
        print(f"prefill {n} tokens of {args.model} ({args.scheme}, {args.scheduler}) on {len(specs)} devices "
              f"{'in turn' if args.sequential else 'at once'}:")
        print(result.format_table(rows))
        if args.trace and ok:
            print(f"wrote {args.trace}: one Perfetto process per device")
    return 0 if len(ok) == len(result.runs) else 1


def _prefill(args, dev, qm, tokens, ids, progress: bool, per_device: bool = False, numerics: dict | None = None):
    """The prefill --scheduler asks for on `dev` -> (RunResult, extra JSON fields). per_device: a measured cost model
    is measured on this device and not cached (the cache is per model and scheme, not per device). numerics: a
    chunked or split prefill's capture (numerics.plan_numerics' keywords)."""
    if args.scheduler == "layer":
        return dev.prefill(qm, tokens, progress=progress), {}
    if args.scheduler == "hetero":
        hp, _ = dev.measure_linears(qm, progress=progress)  # HeteroLLM's profiler on this agent
        res = dev.prefill_hetero(qm, tokens, hp, args.partition, progress=progress, numerics=numerics)
        # "hetero_profile": the field's first name (a contract), the measured HeteroCostModel
        return res, {"partition": res.trace.meta["partition"], "hetero_profile": _plain_fields(hp)}
    from ..schedule import cache

    cost = cache.resolve(args.cost_model, args.model, qm, dev, ids, progress, remeasure=per_device,
                         cache=not per_device)
    res = dev.prefill_chunked(qm, tokens, chunk=args.chunk, scheduler=args.scheduler, cost_model=cost,
                              progress=progress, numerics=numerics)
    return res, {"device_profile": cost.name, "cost_model": cost.name}  # device_profile: the field's first name


def _numerics_refusal(args, specs) -> str | None:
    """Why --numerics and its flags cannot run as asked (None: they can)."""
    given = [f for f, v in (("--numerics-ops", args.numerics_ops), ("--numerics-out", args.numerics_out),
                            ("--numerics-tolerance", args.numerics_tolerance),
                            ("--numerics-max-tolerance", args.numerics_max_tolerance)) if v is not None]
    if not args.numerics:
        return f"{given[0]} applies with --numerics; add --numerics" if given else None
    if len(specs) > 1:
        return "--numerics compares one device with the host: give one --device"
    if args.decode is not None and (args.batch != 1 or args.temperature > 0):
        return ("--numerics with --decode follows one sequence's greedy steps: leave --batch at 1 and --temperature "
                "at 0")
    for flag, v in (("--numerics-tolerance", args.numerics_tolerance),
                    ("--numerics-max-tolerance", args.numerics_max_tolerance)):
        if v is not None and not v > 0:
            return f"{flag} must be a positive relative error, got {v}"
    return None


def _numerics_ops_exist(model, n: int, pattern: str, chunk: int | None = None) -> bool:
    """Whether the glob pattern names an op of the model's n-token prefill (the template's names, nothing run; a
    chunked prefill's c{i}.l{l}.* names too). A HeteroLLM split's pieces are checked against its plan, later."""
    from edgeprobe_kernels.numerics import select

    from ..graph import Weights, model_ops
    from ..numerics import op_names

    names = op_names(model.config, n)
    if chunk is not None:
        names += [o["name"] for o in model_ops(Weights(model.config), n, chunk=chunk)]
    return bool(select(names, pattern))


def _numerics_kw(args, model, progress: bool) -> dict:
    return {"ops": args.numerics_ops, "float_model": model, "tolerance": args.numerics_tolerance,
            "max_tolerance": args.numerics_max_tolerance, "progress": progress}


def _prefill_numerics(args, dev, qm, model, tokens, ids, progress: bool):
    """--numerics: the prefill --scheduler asks for with every chosen op captured (a chunked prefill's chunks, a
    HeteroLLM split's pieces and joins), compared with the host -> (RunResult, extra fields)."""
    from ..numerics import prefill_numerics

    if args.scheduler == "layer":
        res, extra = prefill_numerics(dev, qm, tokens, **_numerics_kw(args, model, progress)), {}
    else:
        res, extra = _prefill(args, dev, qm, tokens, ids, progress, numerics=_numerics_kw(args, model, progress))
    return res, {**extra, "numerics": _numerics_fields(args, res.numerics, res.trace.events, [res.numerics])}


def _numerics_fields(args, rep, events, reports: list) -> dict:
    """run's JSON "numerics": the first divergent op, the largest device-vs-simulation error over `reports`, the
    capture's time on the lanes, the files written."""
    rows = [r for p in reports for r in p.ops]
    worst = max(rows, key=lambda r: r["device_vs_sim"]["rel_l2"])
    out = {"tolerance": reports[0].tolerance, "max_tolerance": reports[0].max_tolerance, "ops": len(rows),
           "full_captured": sum(p.meta["full_captured"] for p in reports),
           "first_divergent": rep.first_divergent,
           "max_device_vs_sim": {"op": worst["op"], **worst["device_vs_sim"]},
           "capture_ms": sum(e["end_us"] - e["start_us"] for e in events if e["kind"] == "numerics") / 1e3}
    if args.numerics_out:
        out["files"] = rep.write(args.numerics_out)
    return out


def _say_numerics(nm: dict) -> None:
    """--numerics in words: the first divergent op, or the largest device-vs-simulation error."""
    f = nm["first_divergent"]
    at = f" at decode step {f['step']}" if f and f.get("phase") == "decode" else " in the prefill" if f and \
        f.get("phase") == "prefill" else ""
    where = (f"first divergent op {f['op']}{at} (relative L2 {f['rel_l2']:.3g}, max |diff| / max |x| "
             f"{f['max_rel']:.3g} vs "
             f"the simulation; tolerances {nm['tolerance']:g} and {nm['max_tolerance']:g})" if f else
             f"no op leaves the simulation by more than relative L2 {nm['tolerance']:g} or max |diff| / max |x| "
             f"{nm['max_tolerance']:g} (largest relative L2: "
             f"{nm['max_device_vs_sim']['op']}, {nm['max_device_vs_sim']['rel_l2']:.3g})")
    files = f"; wrote {nm['files']['json']} and {nm['files']['html']}" if nm.get("files") else ""
    print(f"numerics of {nm['ops']} ops ({nm['full_captured']} whole, capture {nm['capture_ms']:.1f} ms on the "
          f"lanes): {where}{files}")


def _dsp_totals(events) -> dict | None:
    """What the npu lane's Hexagon code would cost on a DSP, summed over the run (None without the hvx backend)."""
    dsp = [e for e in events if e.get("isa")]
    if not dsp:
        return None
    clock = dsp[0].get("dsp_clock_hz")
    packets = sum(int(e.get("hvx_packets", 0)) for e in dsp)
    return {"isa": dsp[0]["isa"], "ops": len(dsp), "hvx_packets": packets,
            "dsp_cycles_estimate": sum(int(e.get("dsp_cycles_estimate", 0)) for e in dsp),
            "dsp_ms_estimate": sum(float(e.get("dsp_us_estimate", 0.0)) for e in dsp) / 1e3, "dsp_clock_hz": clock,
            "qemu_ms": sum(e["end_us"] - e["start_us"] for e in dsp) / 1e3, "dsp_model": dsp[0].get("dsp_model")}


def _run_decode(args, dev, qm, model, tokens, progress: bool, before: int) -> int:
    """--decode N [--batch B]: prefill, then N decode steps on the agent; the final JSON adds decode fields."""
    import numpy as np

    from ..generate import replay
    from ..trace import Trace, cosine

    def stream(i, tok):
        if not args.json:
            print(model.tokenizer.decode([int(tok[0])]), end="", flush=True)

    dec = dev.generate(qm, tokens, args.decode, batch=args.batch, temperature=args.temperature, seed=args.seed,
                       on_step=stream, progress=progress, loop=args.decode_loop)
    if not args.json:
        print()
    host = replay(qm.model, tokens, dec.tokens, linear=qm.linear)
    cos = [min(cosine(a[j], b[j]) for j in range(a.shape[0])) for a, b in zip(dec.logits, host)]
    pre = Trace([e for e in dec.trace.events if e.get("group") == "prefill"], dec.trace.meta).metrics()
    if args.trace:
        dec.trace.to_chrome_json(args.trace)
    n = len(tokens)
    info = dev.info
    out = {"model": args.model, "scheme": args.scheme, "device": args.device, "tokens": int(n),
           "tok_per_s": n / (pre["makespan_ms"] / 1e3), "makespan_ms": pre["makespan_ms"],
           "lanes": {k: round(v["busy_pct"], 2) for k, v in dec.trace.metrics()["lanes"].items()},
           "upload_bytes": int(dev.uploaded_bytes - before), "logits_cosine_vs_host": cos[0],
           "agent": {k: info.get(k) for k in ("agent_version", "lanes", "emulated_lanes", "cores", "cpu", "backends")},
           **_agent_fields(info), "trace": args.trace, "scheduler": "layer", "chunk": None,
           "npu_backend": args.npu_backend, "decode_steps": args.decode, "decode_loop": args.decode_loop,
           "batch": args.batch, "temperature": args.temperature, "seed": args.seed,
           "decode_tok_per_s": dec.decode_tok_per_s,
           "decode_step_ms_median": float(np.median(dec.step_ms)),
           "decode_logits_min_cosine_vs_host": float(min(cos[1:])),
           "texts": [model.tokenizer.decode(row.tolist()) for row in dec.tokens]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"prefill {n} tokens, then {args.decode} decode steps x batch {args.batch} on {args.device}: "
              f"{out['decode_tok_per_s']:.1f} tok/s summed over the batch (median step "
              f"{out['decode_step_ms_median']:.1f} ms); "
              f"logits cosine vs host >= {min(cos):.6f}")
    return 0


def _decode_numerics(args, dev, qm, model, tokens, progress: bool, before: int) -> int:
    """--decode N --numerics: the prompt prefilled in a decode session, then N greedy steps (on the agent's loop or
    the host's, as --decode-loop says), every chosen op of the prefill and of each step captured and compared with the
    host's simulation and float model through their own KV caches."""
    from ..numerics import decode_numerics

    kw = _numerics_kw(args, model, progress)
    res = decode_numerics(dev, qm, tokens, steps=args.decode, loop=args.decode_loop, **kw)
    dn = res.numerics
    if args.trace:
        res.trace.to_chrome_json(args.trace)
    reports = ([dn.prefill] if dn.prefill is not None else []) + dn.steps
    nm = {**_numerics_fields(args, dn, res.trace.events, reports), "steps": len(dn.steps),
          "per_step_max_rel_l2": [max(r["device_vs_sim"]["rel_l2"] for r in p.ops) for p in dn.steps]}
    fed = [int(t) for t in res.outputs["fed"].reshape(-1)]
    out = {"model": args.model, "scheme": args.scheme, "device": args.device, "tokens": len(tokens),
           "decode_steps": args.decode, "decode_loop": args.decode_loop, "batch": 1, "temperature": 0.0,
           "upload_bytes": int(dev.uploaded_bytes - before), "trace": args.trace, "fed": fed,
           "texts": [model.tokenizer.decode(fed)], "numerics": nm}
    if args.json:
        print(json.dumps(out, default=float))
    else:
        print(f"prefill {len(tokens)} tokens, then {args.decode} greedy decode steps on {args.device} with numerics "
              f"captured: {model.tokenizer.decode(fed)!r}")
        _say_numerics(nm)
    return 0


def _agent_fields(info: dict) -> dict:
    """The agent's machine, numba version (None: numpy kernels) and ISA emulator (None: native), for run's JSON."""
    return {"agent_machine": info.get("machine"), "agent_numba": info.get("numba"),
            "agent_emulator": info.get("emulator")}


def _plain_fields(obj) -> dict:
    """A dataclass's fields as JSON values (tuples as lists)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in obj.__dict__.items()}

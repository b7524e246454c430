"""`edgeprobe` command line. Subcommands, flags and the JSON fields of --json are a contract:
extend them, never rename or remove them."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import EdgeprobeError


def cmd_eval(args) -> int:
    from . import models
    from .corpus import corpus_path, read_text_file
    from .evaluate import perplexity

    from .quant.qmodel import check_scheme

    check_scheme(args.scheme)
    model = models.load(args.model)
    text = read_text_file(args.text or corpus_path("heldout"))
    ids = model.tokenizer.encode(text)
    run_model, linear = model, None
    if args.scheme != "float":
        qm = _quantized(model, args.scheme, not args.no_progress, say=_say(args))
        run_model, linear = qm.model, qm.linear
    res = perplexity(run_model, ids, window=args.window, max_windows=args.max_windows, linear=linear,
                     progress=not args.no_progress)
    out = {"model": args.model, "scheme": args.scheme, "text": args.text or "corpus:heldout", **res.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"perplexity {res.perplexity:.3f} over {res.tokens_scored} tokens "
              f"({res.windows} windows of {res.window}); {res.tok_per_s:.0f} tok/s")
    return 0


def _quantized(model, scheme: str, progress: bool, tolerance: float = 0.05, say=None):
    """`model` under `scheme`, calibrated on the bundled training corpus; prepared once and cached across runs
    (edgeprobe.prepare), each step said in one line through `say`."""
    from .prepare import prepared

    return prepared(model, scheme, progress=progress, say=say, tolerance=tolerance)


def _say(args):
    """One-line notes of what a command prepares: on stdout, or on stderr when stdout carries --json."""
    return lambda m: print(f"edgeprobe: {m}", file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def _expert_bits(model, tolerance: float, progress: bool) -> dict:
    """moe-mixed widths chosen on the bundled training corpus (never on the evaluation text)."""
    from .corpus import read_corpus
    from .quant.expert_bits import ExpertBitsStudy

    study = ExpertBitsStudy(model, model.tokenizer.encode(read_corpus("train")),
                            window=min(256, model.config.context_length), max_windows=4, progress=progress)
    return study.select(tolerance).bits


def cmd_quantize(args) -> int:
    from . import models
    from .corpus import corpus_path, read_corpus, read_text_file
    from .quant import calibration_profile, quantize, schemes_for
    from .quant.qmodel import check_scheme
    from .quant.report import accuracy_table, format_table
    from .quant.schemes import NEEDS_PROFILE

    schemes = args.schemes.split(",") if args.schemes else None
    for s in schemes or []:
        check_scheme(s)
    if args.scheme:
        check_scheme(args.scheme)
    if not args.report and not args.out:
        print("edgeprobe: error: quantize needs --report (the accuracy table) and/or --out DIR (with --scheme)",
              file=sys.stderr)
        return 2
    text = read_text_file(args.text or corpus_path("heldout"))
    model = models.load(args.model)
    schemes = schemes or schemes_for(model.config)
    progress = not args.no_progress
    needed = set(schemes if args.report else []) | ({args.scheme or schemes[0]} if args.out else set())
    profile = None
    if needed & NEEDS_PROFILE:
        profile = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=args.calib_tokens,
                                      window=min(args.window, args.calib_tokens), progress=progress)
    bits = _expert_bits(model, args.tolerance, progress) if "moe-mixed" in needed else None
    if args.out:
        scheme = args.scheme or schemes[0]
        qm = quantize(model, scheme, profile, prune_rate=args.prune_rate, coverage=args.coverage, expert_bits=bits)
        qm.save(args.out)
        print(f"wrote {scheme} to {args.out} ({qm.nbytes()['total'] / 1e6:.1f} MB in {len(qm.manifest['blobs'])} blobs)")
    if args.report:
        rows = accuracy_table(model, model.tokenizer.encode(text), profile, schemes, window=args.window,
                              max_windows=args.max_windows, progress=progress, prune_rate=args.prune_rate,
                              coverage=args.coverage, expert_bits=bits)
        if args.json:
            print(json.dumps({"model": args.model, "text": args.text or "corpus:heldout", "rows": rows}))
        else:
            print(format_table(rows))
    return 0


def cmd_generate(args) -> int:
    from . import models
    from .generate import generate

    model = models.load(args.model)
    g = generate(model, args.prompt, n=args.n, temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps({"prompt": g.prompt, "continuation": g.text, "tokens": g.tokens,
                          "prefill_tok_per_s": g.prefill_tok_per_s, "decode_tok_per_s": g.decode_tok_per_s}))
    else:
        print(g.prompt + g.text)
    return 0


def cmd_profile(args) -> int:
    from pathlib import Path

    from . import models
    from .corpus import corpus_path, read_text_file

    if args.shards is not None and args.ray is None:
        print("edgeprobe: error: --shards splits the corpus over a Ray cluster; add --ray local (or --ray ADDRESS)",
              file=sys.stderr)
        return 2
    progress = not args.no_progress
    runner = None
    try:
        if args.ray is not None:  # first: a cluster that cannot be reached fails before the model loads
            from .profile.cluster import RayRunner

            runner = RayRunner(args.ray, shards=args.shards, say=_say(args))
        text = read_text_file(args.corpus or corpus_path("train"))
        model = models.load(args.model or ("tiny-moe" if args.what == "experts" else "smollm2-135m"))
        ids = model.tokenizer.encode(text)
        summary, headline = _profile_job(args, model, ids, progress, runner)
        if runner is not None:  # where every shard ran; summary.json stays the single-process one
            (Path(args.out) / "shards.json").write_text(json.dumps(runner.summary(), indent=1) + "\n")
    finally:
        if runner is not None:
            runner.close()
    summary["out"] = str(args.out)
    if args.json:
        print(json.dumps({**summary, **({"ray": _ray_fields(runner)} if runner else {})}, default=float))
    else:
        print(headline)
        kind = "coactivation" if args.what == "experts" else args.what
        print(f"wrote {args.out}/{kind}.npz, summary.json{', shards.json' if runner else ''} and figures")
    return 0


def _ray_fields(runner) -> dict:
    s = runner.summary()
    return {"address": s["address"], "shards": len(s["shards"]), "workers": s["workers"], "hosts": s["hosts"],
            "shard_seconds": round(sum(r["seconds"] for r in s["shards"]), 3)}


def _profile_job(args, model, ids, progress: bool, runner) -> tuple[dict, str]:
    """The job `edgeprobe profile WHAT` runs -> (summary, headline)."""
    from .corpus import corpus_path, read_text_file
    from .profile import jobs

    if args.what == "experts":
        held = model.tokenizer.encode(read_text_file(args.heldout or corpus_path("heldout")))
        window = args.window or min(256, model.config.context_length)
        summary = jobs.run_experts_job(model, ids, held, args.out, tokens=args.tokens or 32768, window=window,
                                       heldout_tokens=args.heldout_tokens, bit_widths=args.bit_widths,
                                       progress=progress, runner=runner)
        pl, hr = summary["path_power_law"], summary["predictor_hit_rate"]
        k = model.config.n_experts_used
        headline = (f"experts: top 20% of {pl['paths_observed']} paths cover "
                    f"{100 * summary['top20pct_paths_token_share']:.1f}% of tokens (power law alpha {pl['alpha']:.2f}); "
                    f"preload hit rate top-{k} {100 * hr['order2'][f'top{k}']:.1f}% (frequency only "
                    f"{100 * hr['order0'][f'top{k}']:.1f}%)")
    elif args.what == "outliers":
        summary = jobs.run_outliers_job(model, ids, args.out, tokens=args.tokens or 32768, window=args.window or 512,
                                        percentile=args.percentile, prune_rate=args.prune_rate,
                                        coverage=args.coverage, progress=progress, runner=runner)
        headline = (f"outliers: {summary['fig10_outlier_channels_per_window_mean']:.1f} channels per window "
                    f"({summary['fig10_outlier_channels_pct_mean']:.2f}%); 80% of outliers from "
                    f"{summary['fig11_pct_channels_for_80pct_outliers']:.2f}% of channels; kept layers "
                    f"{summary['kept_layers']}")
    else:
        summary = jobs.run_sparsity_job(model, ids, args.out, tokens=args.tokens or 16384, window=args.window or 512,
                                        eps=args.eps, bits=args.bits, rank=args.rank,
                                        predictor=not args.no_predictor, progress=progress, runner=runner)
        headline = (f"sparsity: {100 * summary['inactive_fraction_mean']:.1f}% of FFN neurons inactive at "
                    f"eps {100 * args.eps:g}% (achieved {100 * summary['achieved_error_mean']:.2f}%); "
                    f"80% of firings from {summary['hot_neurons_pct_for_80pct_mean']:.0f}% of neurons")
    return summary, headline


def cmd_run(args) -> int:
    from . import models
    from .corpus import corpus_path, read_text_file
    from .device import check_device_spec
    from .quant.qmodel import check_scheme

    check_scheme(args.scheme)
    specs = args.device or ["local"]
    for spec in specs:
        try:
            check_device_spec(spec)
        except ValueError as e:
            print(f"edgeprobe: error: {e}", file=sys.stderr)
            return 2
    if args.scheduler != "layer" and args.chunk < 1:
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
        print("edgeprobe: error: --decode prefills layer by layer inside its decode session; leave --scheduler at layer",
              file=sys.stderr)
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
    if len(specs) > 1 and args.decode is not None:
        print("edgeprobe: error: --decode runs on one device; give one --device (several run one prefill and compare)",
              file=sys.stderr)
        return 2
    say = _say(args)
    model = models.load(args.model)
    ids = model.tokenizer.encode(read_text_file(args.prompt_file or corpus_path("heldout")))
    if not len(ids):
        print(f"edgeprobe: error: the prompt file {args.prompt_file} holds no tokens; give it some text", file=sys.stderr)
        return 2
    n = args.prompt_len or min(len(ids), 256)
    if len(ids) < n:  # a short prompt file is a prompt, not a mistake: run all of it
        say(f"the prompt has {len(ids)} tokens, fewer than --prompt-len {n}: prefilling all {len(ids)}")
        n = len(ids)
    if n + (args.decode or 0) > model.config.context_length:
        print(f"edgeprobe: error: --prompt-len {n}{f' + --decode {args.decode}' if args.decode else ''} exceeds the "
              f"context length {model.config.context_length}", file=sys.stderr)
        return 2
    tokens = ids[:n]
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
        f"{prefix}the agent{where} already holds all {len(qm.manifest['blobs'])} blobs of this model: nothing to upload")
    return sent


def _numba_reference(args, qm, tokens, ids, progress: bool):
    """The same plan on a local agent's numba kernels -> (its RunResult, its numba version; None: none here either)."""
    from .device import Device

    with Device.local(npu_backend="numba") as ref_dev:
        ref, _ = _prefill(args, ref_dev, qm, tokens, ids, progress)
        return ref, ref_dev.info.get("numba")


def _run_fields(args, device: str, res, extra: dict, upload: int, info: dict, host, n: int) -> dict:
    """run's JSON object for one device's prefill (a contract: extend, never rename)."""
    import numpy as np

    from .trace import cosine

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
    from .trace import cosine

    ref_res, ref_numba = ref
    return {"numba_reference_numba": ref_numba,
            "logits_max_abs_diff_vs_numba": float(np.abs(res.logits.astype(np.float64) - ref_res.logits).max()),
            "logits_cosine_vs_numba": cosine(res.logits[-1], ref_res.logits[-1]),
            "top1_equals_numba": bool(np.argmax(res.logits[-1]) == np.argmax(ref_res.logits[-1])),
            "numba_reference_device": "local"}


def _run_one(args, model, ids, tokens, say) -> int:
    from .device import open_device
    from .schedule import ScheduleError

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
        qm = _quantized(model, args.scheme, progress, say=say)
    except BaseException:
        dev.close()  # the agent must not wait out its heartbeat for a host that failed before using it
        raise
    with dev:
        before = dev.uploaded_bytes
        _upload(dev, qm, progress, say)
        try:
            if args.decode:
                return _run_decode(args, dev, qm, model, tokens, progress, before)
            res, extra = _prefill(args, dev, qm, tokens, ids, progress)
        except ScheduleError as e:
            print(f"edgeprobe: error: {e}", file=sys.stderr)
            return 2
        upload = dev.uploaded_bytes - before
        info = dev.info
    if args.npu_backend != "numba" or not info.get("numba"):  # the same plan on a local agent's numba kernels
        extra.update(_reference_fields(args, res, info, _numba_reference(args, qm, tokens, ids, progress)))
    extra["npu_backend"] = args.npu_backend
    extra["npu_dsp"] = _dsp_totals(res.trace.events)
    host = _host_logits(qm, tokens, args.chunk if args.scheduler in ("in-order", "ooo") else None)
    out = _run_fields(args, args.device, res, extra, upload, info, host, n)
    m = res.trace.metrics()
    if args.trace:
        res.trace.to_chrome_json(args.trace)
    if args.json:
        print(json.dumps(out))
    else:
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in out["lanes"].items())
        print(f"prefill {n} tokens on {args.device}: {out['tok_per_s']:.0f} tok/s, makespan {m['makespan_ms']:.1f} ms "
              f"(busy: {busy}); uploaded {upload / 1e6:.1f} MB; logits cosine vs host {out['logits_cosine_vs_host']:.6f}")
        if out["predicted_makespan_ms"]:
            print(f"predicted makespan {out['predicted_makespan_ms']:.1f} ms = {out['predicted_over_measured']:.2f}x the "
                  f"measured ({out.get('device_profile', args.device_profile)} cost model)")
        if out["npu_dsp"]:
            d = out["npu_dsp"]
            print(f"npu lane on {d['isa']} (qemu-hexagon): {d['hvx_packets']} packets, estimated {d['dsp_ms_estimate']:.2f} ms "
                  f"on a DSP at {d['dsp_clock_hz'] / 1e9:g} GHz; logits max |diff| vs numba "
                  f"{out['logits_max_abs_diff_vs_numba']:.3g}")
    return 0


def _run_farm(args, specs, model, ids, tokens, say) -> int:
    """Several --device: one prefill on every agent at once (edgeprobe.farm), a comparison table, one Perfetto file
    with a process per device. Exit 1 when a device failed mid-run (its row says why), 2 when one cannot be used."""
    from .device import open_device
    from .farm import Farm

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
        qm = _quantized(model, args.scheme, progress, say=say)
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
    host = _host_logits(qm, tokens, args.chunk if args.scheduler in ("in-order", "ooo") else None)
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


def _prefill(args, dev, qm, tokens, ids, progress: bool, per_device: bool = False):
    """The prefill --scheduler asks for on `dev` -> (RunResult, extra JSON fields). per_device: a measured cost model
    is measured on this device and not cached (the cache is per model and scheme, not per device)."""
    if args.scheduler == "layer":
        return dev.prefill(qm, tokens, progress=progress), {}
    if args.scheduler == "hetero":
        hp, _ = dev.measure_linears(qm, progress=progress)  # HeteroLLM's profiler on this agent
        res = dev.prefill_hetero(qm, tokens, hp, args.partition, progress=progress)
        return res, {"partition": res.trace.meta["partition"], "hetero_profile": _plain_profile(hp)}
    prof = _device_profile(args.device_profile, args.model, qm, dev, ids, progress, remeasure=per_device,
                           cache=not per_device)
    res = dev.prefill_chunked(qm, tokens, chunk=args.chunk, scheduler=args.scheduler, profile=prof, progress=progress)
    return res, {"device_profile": prof.name}


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

    from .generate import replay
    from .trace import Trace, cosine

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
           **_agent_fields(info), "trace": args.trace, "scheduler": "layer", "chunk": None, "npu_backend": args.npu_backend,
           "decode_steps": args.decode, "decode_loop": args.decode_loop, "batch": args.batch, "temperature": args.temperature, "seed": args.seed,
           "decode_tok_per_s": dec.decode_tok_per_s,
           "decode_step_ms_median": float(np.median(dec.step_ms)),
           "decode_logits_min_cosine_vs_host": float(min(cos[1:])),
           "texts": [model.tokenizer.decode(row.tolist()) for row in dec.tokens]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"prefill {n} tokens, then {args.decode} decode steps x batch {args.batch} on {args.device}: "
              f"{out['decode_tok_per_s']:.1f} tok/s summed over the batch (median step {out['decode_step_ms_median']:.1f} ms); "
              f"logits cosine vs host >= {min(cos):.6f}")
    return 0


def _agent_fields(info: dict) -> dict:
    """The agent's machine, numba version (None: numpy kernels) and ISA emulator (None: native), for run's JSON."""
    return {"agent_machine": info.get("machine"), "agent_numba": info.get("numba"), "agent_emulator": info.get("emulator")}


def _plain_profile(p) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in p.__dict__.items()}


def _profile_cache(model_name: str, scheme: str):
    from pathlib import Path

    from .models import default_cache_dir

    return default_cache_dir() / "profiles" / f"{Path(model_name).name}-{scheme}.json"


def _device_profile(name: str, model_name: str, qm, dev, tokens, progress: bool, remeasure: bool = False,
                    cache: bool = True):
    """--device-profile: a named modelled profile, a measured profile's .json, or measured / measured-real:
    measured on `dev` (a local agent when None) and cached per model and scheme under the edgeprobe cache (unless
    cache is False: a farm measures each device for itself)."""
    from .schedule import device_profile
    from .schedule.measure import MeasuredProfile

    if name not in ("measured", "measured-real"):
        return device_profile(name)
    mode = "real" if name == "measured-real" else "predicted"
    path = _profile_cache(model_name, qm.scheme)
    if path.exists() and not remeasure:
        return MeasuredProfile.from_json(path, mode)
    if dev is None:
        from .device import Device

        with Device.local() as local:
            prof = local.measure_profile(qm, tokens, progress=progress)
    else:
        prof = dev.measure_profile(qm, tokens, progress=progress)
    if cache:
        prof.to_json(path)
    return prof.with_mode(mode)


def _host_logits(qm, tokens, chunk):
    """The host's simulation of what the agent ran: one pass, or chunk by chunk through a KV cache (a
    quantized model's rounding makes the two differ slightly, so compare like with like)."""
    from .forward import KVCache, forward

    if not chunk:
        return qm.forward(tokens, logits="last")
    cache = KVCache(qm.model.config)
    for i in range(0, len(tokens), chunk):
        out = forward(qm.model, tokens[i:i + chunk], cache=cache, linear=qm.linear, logits="last")
    return out


def cmd_schedule(args) -> int:
    from . import models
    from .schedule import ScheduleError, chunk_graph, schedule

    model = models.load(args.model)
    shadow = True
    try:
        cached = _profile_cache(args.model, "w8a8-shadow")
        if args.device_profile in ("measured", "measured-real") and cached.exists() and not args.remeasure:
            from .schedule.measure import MeasuredProfile

            prof = MeasuredProfile.from_json(cached, "real" if args.device_profile == "measured-real" else "predicted")
            shadow = prof.meta.get("shadow_layers", True)
        elif args.device_profile in ("measured", "measured-real"):
            from .corpus import read_corpus
            from .plan import shadow_layers

            qm = _quantized(model, "w8a8-shadow", not args.no_progress, say=_say(args))
            shadow = shadow_layers(qm.manifest)  # the graph the measured agent runs
            prof = _device_profile(args.device_profile, args.model, qm, None, model.tokenizer.encode(read_corpus("heldout")),
                                   not args.no_progress, True)
        else:
            prof = _device_profile(args.device_profile, args.model, None, None, None, False)
    except ScheduleError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    graph = chunk_graph(model.config, args.prompt_len, args.chunk, shadow=shadow)
    sched = schedule(graph, prof, args.scheduler)
    base = schedule(graph, prof, "in-order") if args.scheduler != "in-order" else sched
    mem = graph.memory()
    out = {"model": args.model, "prompt_len": args.prompt_len, "chunk": args.chunk, "scheduler": args.scheduler,
           "device_profile": prof.name, "modelled": prof.modelled, "profile_source": prof.source,
           "prediction_error": prof.fit_error() if hasattr(prof, "fit_error") else None,
           "subgraphs": len(graph.subgraphs), "makespan_ms": sched.makespan_us / 1e3,
           "makespan_vs_in_order": sched.makespan_us / base.makespan_us,
           "lanes": {k: round(v, 2) for k, v in sched.busy().items()}, "decision_us": sched.decision_us,
           "memory": {k: mem[k] for k in ("chunk_graphs_bytes", "chunk_shared_bytes", "saving", "shared_subgraphs",
                                          "subgraphs_per_chunk")}, "out": args.out}
    if args.out:
        from pathlib import Path

        doc = {**out, "slots": {n: {"lane": l, "start_us": s, "end_us": e} for n, (l, s, e) in sched.slots.items()},
               "deps": {g.name: g.deps for g in graph.subgraphs}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc))
    if args.json:
        print(json.dumps(out))
    else:
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in out["lanes"].items())
        print(f"{args.scheduler} on {prof.name} ({'modelled' if prof.modelled else 'measured'}): makespan {out['makespan_ms']:.1f} ms "
              f"({out['makespan_vs_in_order']:.2f}x in-order), busy {busy}; {len(graph.subgraphs)} subgraphs, "
              f"{sched.decision_us:.1f} us per decision; chunk-shared graphs save {100 * mem['saving']:.0f}% memory")
    return 0


def cmd_agent(args) -> int:
    from edgeprobe_agent.__main__ import main as agent_main

    argv = ["--bind", args.bind, "--store", args.store]
    if args.memory_budget is not None:
        argv += ["--memory-budget", str(args.memory_budget)]
    if args.curve_keys:
        argv += ["--curve-keys", args.curve_keys]
    if args.lanes:
        argv += ["--lanes", args.lanes]
    argv += ["--npu-backend", args.npu_backend]
    return agent_main(argv)


def cmd_kernels(args) -> int:
    """kernels check: every kernel of a backend against its numpy reference; exit 1 on any mismatch."""
    from edgeprobe_kernels.check import BackendUnavailable, check

    try:
        res = check(args.backend, seed=args.seed)
    except BackendUnavailable as e:
        print(f"edgeprobe: error: backend {args.backend} is unavailable here: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        for name, r in res["kernels"].items():
            verdict = "ok" if r["ok"] else "MISMATCH"
            print(f"{args.backend:7s} {name:22s} {r['cases']:3d} cases  bit-exact {str(r['bit_exact']):5s}  "
                  f"max |err| {r['max_abs_err']:.3g}  {verdict}")
    return 0 if res["ok"] else 1


def cmd_demo(args) -> int:
    from .demo import DemoError, run_demo

    try:
        run_demo(model=args.model, out=args.out, prompt_len=args.prompt_len, chunk=args.chunk, eval_windows=args.max_windows,
                 profile_tokens=args.profile_tokens, progress=not args.no_progress, repeats=args.repeats)
    except DemoError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """Names the schemes in --scheme/--schemes help from the registry itself, imported only when help is printed
    (the registry pulls in the kernels: a second of imports no other command line should pay)."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if action.dest in ("scheme", "schemes"):
            from .quant.schemes import SCHEMES

            text += f" (choices: {', '.join(SCHEMES)})"
        return text


def _cmd(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with what it does (its one-line help, unless a longer description is given)."""
    return sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".",
                          formatter_class=_HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgeprobe", description="Profile, quantize, schedule and run LLMs for phones.",
                                 formatter_class=_HelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    e = _cmd(sub, "eval", help="perplexity of a model on a text (non-overlapping windows)")
    e.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    e.add_argument("--text", help="UTF-8 text file (default: the bundled held-out corpus)")
    e.add_argument("--window", type=int, default=512, help="window length in tokens (default 512)")
    e.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    e.add_argument("--scheme", default="float", help="quantization scheme to simulate (default float)")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(fn=cmd_eval)

    g = _cmd(sub, "generate", help="continue a prompt (greedy unless --temperature > 0)",
                       description="Continue a prompt on the host with the float forward pass and a KV cache: greedy "
                                   "unless --temperature > 0 (then sampled with --seed). Prints the prompt and its "
                                   "continuation, or with --json the tokens and prefill/decode tokens per second.")
    g.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("-n", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples softmax(z / T)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    g.set_defaults(fn=cmd_generate)

    q = _cmd(sub, "quantize", help="quantize a model; --report prints the accuracy table of every scheme",
                       description="Quantize a model. --report: perplexity, top-1 agreement and bytes of every scheme "
                                   "on the same held-out text (calibrated on the bundled training corpus). --out DIR "
                                   "--scheme S: write one quantized model (manifest.json + sha256-named blobs).")
    q.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    q.add_argument("--report", action="store_true", help="accuracy table: every scheme on the same text")
    q.add_argument("--text", help="evaluation text (default: the bundled held-out corpus)")
    q.add_argument("--schemes", help="comma-separated schemes for the report (default: all)")
    q.add_argument("--scheme", help="scheme to write with --out")
    q.add_argument("--out", help="folder for the quantized model: manifest.json + blobs/")
    q.add_argument("--window", type=int, default=512, help="evaluation window in tokens (default 512)")
    q.add_argument("--max-windows", type=int, default=8, help="windows of the text to evaluate (default 8)")
    q.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens from the training corpus")
    q.add_argument("--prune-rate", type=float, default=0.85, help="w8a8-shadow: layers whose outliers are dropped")
    q.add_argument("--coverage", type=float, default=0.8, help="w8a8-shadow: hot-channel coverage")
    q.add_argument("--tolerance", type=float, default=0.05,
                   help="moe-mixed: tolerated perplexity increase P for the per-expert widths (default 0.05)")
    q.add_argument("--json", action="store_true", help="--report as one JSON object")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.set_defaults(fn=cmd_quantize)

    p = _cmd(sub, "profile", help="profile activation outliers, FFN sparsity or MoE expert routing on a corpus")
    kinds = p.add_subparsers(dest="what", required=True, metavar="{outliers,sparsity,experts}")
    p_help = {"outliers": ("activation outliers per layer and channel (mllm-NPU Fig. 10-12)", 32768, 512),
              "sparsity": ("FFN activation sparsity, sliding windows, a neuron predictor (LLM in a flash)", 16384, 512),
              "experts": ("MoE expert routing: co-activation paths, preload predictor, buffers (EdgeMoE)", 32768, 256)}
    for what, (text, tokens, window) in p_help.items():
        pk = kinds.add_parser(what, help=text, description=f"Profile {text} on a corpus; writes {what if what != 'experts' else 'coactivation'}.npz, "
                              "summary.json and figures as HTML.", formatter_class=_HelpFormatter)
        pk.add_argument("--model", default=None, help=f"default {'tiny-moe' if what == 'experts' else 'smollm2-135m'}")
        pk.add_argument("--corpus", help="UTF-8 text file (default: the bundled training corpus)")
        pk.add_argument("--tokens", type=int, default=None, help=f"tokens to profile (default {tokens})")
        pk.add_argument("--window", type=int, default=None, help=f"tokens per inference window (default {window})")
        pk.add_argument("--out", required=True, help="output folder: .npz, summary.json, figures as HTML")
        pk.add_argument("--json", action="store_true", help="print the summary as one JSON line, last")
        pk.add_argument("--no-progress", action="store_true", help="no progress bars")
        pk.add_argument("--ray", metavar="ADDRESS", default=None,
                        help="shard the corpus's windows over a Ray cluster: local (this machine's cores), auto, "
                             "HOST:PORT of a `ray start --head`, or ray://HOST:PORT; summary.json equals the "
                             "single-process run's, shards.json says where each shard ran")
        pk.add_argument("--shards", type=int, default=None,
                        help="--ray: shards per pass (default 4 per CPU of the cluster, at most one per window)")
        pk.set_defaults(fn=cmd_profile, what=what, percentile=99.99, prune_rate=0.85, coverage=0.8, eps=0.01, bits=4.0,
                        rank=32, no_predictor=False, heldout=None, heldout_tokens=8192, bit_widths=False)
        if what == "outliers":
            pk.add_argument("--percentile", type=float, default=99.99, help="clip = this percentile of |x|")
            pk.add_argument("--prune-rate", type=float, default=0.85, help="fraction of layers whose outliers are pruned")
            pk.add_argument("--coverage", type=float, default=0.8, help="hot-channel coverage")
        elif what == "sparsity":
            pk.add_argument("--eps", type=float, default=0.01, help="allowed relative FFN output error")
            pk.add_argument("--bits", type=float, default=4.0, help="weight bits for flash traffic")
            pk.add_argument("--rank", type=int, default=32, help="predictor rank")
            pk.add_argument("--no-predictor", action="store_true", help="skip the low-rank predictor")
        else:
            pk.add_argument("--heldout", help="held-out text for predictor and cache (default: bundled held-out corpus)")
            pk.add_argument("--heldout-tokens", type=int, default=8192, help="held-out tokens replayed (default 8192)")
            pk.add_argument("--bit-widths", action="store_true",
                            help="also measure per-expert INT2 sensitivity and width selections (EdgeMoE §3.2)")

    r = _cmd(sub, "run", help="run a quantized prefill on a device agent and bring the trace back")
    r.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    r.add_argument("--scheme", default="w8a8-shadow", help="quantization scheme run on the agent (default w8a8-shadow)")
    r.add_argument("--prompt-file", help="UTF-8 prompt text (default: the bundled held-out corpus)")
    r.add_argument("--prompt-len", type=int, default=None,
                   help="tokens of the prompt to prefill (default 256); a shorter prompt file is prefilled whole")
    r.add_argument("--device", action="append", default=None,
                   help="local | arm64 (a local agent in an emulated arm64 Python, no numba) | tcp://HOST:PORT | "
                        "ssh://USER@HOST[:PORT]; repeat it (--device A --device B) to run the same prefill on every "
                        "device at once and print a comparison table (default local)")
    r.add_argument("--sequential", action="store_true",
                   help="several --device: run them one after another, not at once (agents sharing this host's cores "
                        "slow each other)")
    r.add_argument("--store", default=None,
                   help="--device local / arm64: the agent's blob store (its flash). Default $EDGEPROBE_AGENT_STORE, "
                        "else <tmp>/edgeprobe-agent-store-<uid>; when another agent holds that one, a free sibling "
                        "(<store>-2, ...) is used and said")
    r.add_argument("--scheduler", default="layer", choices=["layer", "in-order", "ooo", "hetero"],
                   help="layer: one layer-by-layer pass; in-order / ooo: chunked prefill scheduled by mllm-NPU §3.4; "
                        "hetero: every int8 GEMM partitioned between the gpu and npu lanes by HeteroLLM's solver "
                        "(rates measured on the agent first)")
    r.add_argument("--chunk", type=int, default=256, help="chunk length for --scheduler in-order|ooo (default 256)")
    r.add_argument("--device-profile", default="this-host-emulated",
                   help="cost model the in-order/ooo scheduler plans with: a named profile, measured, measured-real, "
                        "or a measured profile's .json (default this-host-emulated)")
    r.add_argument("--partition", default="solver", choices=["solver", "gpu", "npu-pad", "pipe", "seq-cut", "row-cut"],
                   help="--scheduler hetero: the solver's choice per matmul, or one strategy for all (baselines)")
    r.add_argument("--decode", type=int, default=None, metavar="N",
                   help="after the prefill, run N decode steps on the agent (its KV cache stays there)")
    r.add_argument("--batch", type=int, default=1, help="--decode: sequences decoded together (test-time scaling)")
    r.add_argument("--temperature", type=float, default=0.0, help="--decode: 0 = greedy, else sampled")
    r.add_argument("--decode-loop", default="host", choices=["host", "agent"],
                   help="--decode: the host samples each token (a round trip per token; any temperature), or the agent "
                        "loops greedily itself (one request for all steps, as a phone's runtime does)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--npu-backend", default="numba", choices=["numba", "hvx"],
                   help="the npu lane's kernels: numba (NPU semantics on this CPU) or hvx (Hexagon v67 HVX code under "
                        "qemu-hexagon; the JSON then adds logits_max_abs_diff_vs_numba, logits_cosine_vs_numba and "
                        "top1_equals_numba from a second, numba run)")
    r.add_argument("--ssh-key", help="private key for --device ssh://")
    r.add_argument("--known-hosts", help="known_hosts file that must hold the device's host key (ssh)")
    r.add_argument("--trace", help="write the trace as Chrome/Perfetto JSON here")
    r.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(fn=cmd_run)

    s = _cmd(sub, "schedule", help="chunk a prompt and schedule its subgraphs (mllm-NPU §3.2, §3.4), predicted",
                       description="Cut a prompt into chunks, build the chunk-shared subgraph DAG (mllm-NPU §3.2) and "
                                   "order it on the lanes (§3.4) over a cost model: prints the predicted makespan, its "
                                   "ratio to in-order, lane busy % and the memory chunk-shared graphs save. Nothing "
                                   "runs on an agent (except to measure a 'measured' cost model); `edgeprobe run "
                                   "--scheduler` runs it.")
    s.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    s.add_argument("--prompt-len", type=int, required=True, help="prompt tokens to schedule")
    s.add_argument("--chunk", type=int, default=256, help="chunk length in tokens (default 256)")
    s.add_argument("--scheduler", default="ooo", choices=["in-order", "ooo", "exact"],
                   help="in-order, ooo (mllm-NPU eq. 6, default) or exact (branch and bound, <= 12 subgraphs)")
    s.add_argument("--device-profile", default="snapdragon-8gen3",
                   help="a named modelled profile (snapdragon-8gen3, this-host-emulated); measured (fitted to subgraph "
                        "times measured on a local agent, HeteroLLM's predicted mode) or measured-real (the measured "
                        "times themselves where measured); or a measured profile's .json")
    s.add_argument("--remeasure", action="store_true", help="measure again instead of using the cached measured profile")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--out", help="write the schedule (slots, dependencies, metrics) as JSON here")
    s.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    s.set_defaults(fn=cmd_schedule)

    a = _cmd(sub, "agent", help="start a device agent here (same as python -m edgeprobe_agent)")
    a.add_argument("--bind", default="tcp://127.0.0.1:5555")
    a.add_argument("--store", default=str(__import__("pathlib").Path.home() / ".cache" / "edgeprobe" / "agent-store"))
    a.add_argument("--memory-budget", type=float, default=None, help="MB of blobs kept resident")
    a.add_argument("--curve-keys", help="folder with server.key_secret; required off loopback")
    a.add_argument("--lanes", help="comma-separated lanes to offer, e.g. cpu,npu (default: all this machine has)")
    a.add_argument("--npu-backend", default="numba", choices=["numba", "hvx"],
                   help="the npu lane's kernels: numba (NPU semantics) or hvx (Hexagon code under qemu-hexagon)")
    a.set_defaults(fn=cmd_agent)

    k = _cmd(sub, "kernels", help="check a backend's kernels against their numpy references")
    k.add_argument("action", choices=["check"])
    k.add_argument("--backend", default="numba", choices=["numba", "hvx", "opencl"],
                   help="numba: NPU semantics on this CPU; hvx: Hexagon v67 HVX code under qemu-hexagon; opencl: the gpu lane")
    k.add_argument("--seed", type=int, default=0, help="random cases' seed")
    k.add_argument("--json", action="store_true", help="print one JSON object: {kernels: {name: {cases, bit_exact, "
                                                       "max_abs_err}}, ok}")
    k.set_defaults(fn=cmd_kernels)

    d = _cmd(sub, "demo", help="the main job: profile, quantize, schedule, run on a local agent, report")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--out", default="out", help="folder for report.html, trace.json, summary.json (and .cache/)")
    d.add_argument("--prompt-len", type=int, default=1024, help="prompt of the scheduled prefill")
    d.add_argument("--chunk", type=int, default=256, help="chunk length of the scheduled prefill")
    d.add_argument("--profile-tokens", type=int, default=8192, help="training-corpus tokens profiled for outliers")
    d.add_argument("--max-windows", type=int, default=8, help="held-out windows of 512 for the perplexity")
    d.add_argument("--repeats", type=int, default=2, help="runs per scheduler on the agent; the best is reported")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EdgeprobeError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgeprobe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

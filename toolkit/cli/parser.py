"""The `edgeprobe` argument parser. Subcommands, flags and defaults are a contract: extend them, never rename or
remove them (a renamed flag keeps its old spelling as an alias)."""
from __future__ import annotations

import argparse

from edgeprobe_kernels.paths import cache_root

from ..foreign.read import FORMATS
from .agent import cmd_agent, cmd_kernels
from .cache import cmd_cache
from .demo import cmd_demo
from .evaluate import cmd_eval, cmd_generate
from .predict import cmd_predict
from .profile import cmd_profile
from .quant import cmd_quantize
from .run import cmd_run
from .schedule import cmd_schedule
from .trace import cmd_trace


class _HelpFormatter(argparse.HelpFormatter):
    """Names the schemes in --scheme/--schemes help from the registry itself, imported only when help is printed
    (the registry pulls in the kernels: a second of imports no other command line should pay)."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if action.dest in ("scheme", "schemes"):
            from ..quant.schemes import SCHEMES

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
    e.add_argument("--order", choices=("window", "layer"), default="window",
                   help="window: each window through every layer; layer: every window through layer i, then layer "
                        "i+1, each layer's weights read once (for a model larger than memory; the same perplexity, "
                        "bit for bit)")
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
        npz = what if what != "experts" else "coactivation"
        pk = kinds.add_parser(what, help=text, description=f"Profile {text} on a corpus; writes {npz}.npz, "
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
        pk.add_argument("--order", choices=("window", "layer"), default="window",
                        help="window: each window through every layer; layer: every window through layer i, then "
                             "layer i+1, each layer's weights read once per pass (the same statistics, bit for bit; "
                             "with --ray, each shard's windows)")
        pk.set_defaults(fn=cmd_profile, what=what, percentile=99.99, prune_rate=0.85, coverage=0.8, eps=0.01, bits=4.0,
                        rank=32, no_predictor=False, heldout=None, heldout_tokens=8192, bit_widths=False)
        if what == "outliers":
            pk.add_argument("--percentile", type=float, default=99.99, help="clip = this percentile of |x|")
            pk.add_argument("--prune-rate", type=float, default=0.85,
                            help="fraction of layers whose outliers are pruned")
            pk.add_argument("--coverage", type=float, default=0.8, help="hot-channel coverage")
        elif what == "sparsity":
            pk.add_argument("--eps", type=float, default=0.01, help="allowed relative FFN output error")
            pk.add_argument("--bits", type=float, default=4.0, help="weight bits for flash traffic")
            pk.add_argument("--rank", type=int, default=32, help="predictor rank")
            pk.add_argument("--no-predictor", action="store_true", help="skip the low-rank predictor")
        else:
            pk.add_argument("--heldout",
                            help="held-out text for predictor and cache (default: bundled held-out corpus)")
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
                        "else <edgeprobe cache>/agent-store[-arm64]; when another agent holds that one, a free sibling "
                        "(<store>-2, ...) is used and said")
    r.add_argument("--scheduler", default="layer", choices=["layer", "in-order", "ooo", "hetero"],
                   help="layer: one layer-by-layer pass; in-order / ooo: chunked prefill scheduled by mllm-NPU §3.4; "
                        "hetero: every int8 GEMM partitioned between the gpu and npu lanes by HeteroLLM's solver "
                        "(rates measured on the agent first)")
    r.add_argument("--chunk", type=int, default=None,
                   help="chunk length for --scheduler in-order|ooo (default 256)")
    r.add_argument("--cost-model", "--device-profile", dest="cost_model", default="this-host-emulated",
                   help="cost model the in-order/ooo scheduler plans with and predicts the makespan by: a named one "
                        "(snapdragon-8gen3, this-host-emulated), measured, measured-real, or a measured cost model's "
                        ".json. Default this-host-emulated: run measures on an agent on this host, so its plan and "
                        "predicted_over_measured are priced for the lanes that actually run (schedule defaults to "
                        "snapdragon-8gen3: it predicts for the phone); the JSON's cost_model names the one used; "
                        "--device-profile is its old name")
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
    r.add_argument("--numerics", action="store_true",
                   help="capture each op's output on the agent (L2, max, mean, log2 histogram, non-finite count; "
                        "whole tensors where they fit) and compare it op by op with the host's simulation of the "
                        "scheme and with the float model; the JSON adds numerics (the first divergent op). With "
                        "--scheduler in-order/ooo each chunk's ops (c{i}.l{l}.*) against the host's same chunk; with "
                        "hetero each split linear's pieces and join; with --decode N the prefill and every greedy "
                        "step (batch 1)")
    r.add_argument("--numerics-ops", metavar="PATTERN",
                   help="with --numerics: the ops to capture, comma-separated globs ('blk.1.*,lm_head'; default all)")
    r.add_argument("--numerics-out", metavar="DIR",
                   help="with --numerics: write numerics.json and numerics.html (divergence by depth) here")
    r.add_argument("--numerics-tolerance", type=float, metavar="REL_L2",
                   help="with --numerics: the device-vs-simulation relative L2 error past which an op diverged "
                        "(default per scheme: 1e-4; q4_0-tile 5e-3)")
    r.add_argument("--numerics-max-tolerance", type=float, metavar="MAX_REL",
                   help="with --numerics: the max |device - simulation| / max |simulation| past which an op "
                        "diverged: one int8 code rounded the other way (default per scheme: 2e-5; q4_0-tile 1e-2)")
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
    s.add_argument("--scheme", default="w8a8-shadow",
                   help="quantization scheme whose graph is scheduled (default w8a8-shadow, as run): its prepared "
                        "model (cached, shared with run) decides which layers keep shadow-outlier GEMMs")
    s.add_argument("--cost-model", "--device-profile", dest="cost_model", default="snapdragon-8gen3",
                   help="a named modelled cost model (snapdragon-8gen3, this-host-emulated); measured (fitted to "
                        "subgraph times measured on a local agent, HeteroLLM's predicted mode) or measured-real (the "
                        "measured times themselves where measured); or a measured cost model's .json. Default "
                        "snapdragon-8gen3: schedule predicts what the paper's phone would do (run defaults to "
                        "this-host-emulated: it measures here); with the same --cost-model, scheme, prompt length, "
                        "chunk and scheduler, schedule and run predict the same makespan; the JSON's cost_model names "
                        "the one used; --device-profile is its old name")
    s.add_argument("--remeasure", action="store_true",
                   help="measure again instead of using the cached measured cost model")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--out", help="write the schedule (slots, dependencies, metrics) as JSON here")
    s.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    s.set_defaults(fn=cmd_schedule)

    pr = _cmd(sub, "predict", help="what a phone SoC should give for a model: prefill and decode, from its config",
              description="Predict a model's prefill and decode on a phone SoC from its configuration alone (no "
                          "weights): each op priced by max(FLOPs / rate of its dtype, bytes / bandwidth) plus its "
                          "fixed costs on the lane the strategy gives it (the SoC files of edgeprobe.schedule.soc, "
                          "every number sourced). Prints the times, tok/s, the lanes' busy shares and what bound "
                          "each phase (compute, bandwidth, overhead, flash).")
    pr.add_argument("--model", default="smollm2-135m",
                    help="a config.json, a Hugging Face folder, a GGUF file or a built-in name")
    pr.add_argument("--soc", default="snapdragon-8gen3",
                    help="snapdragon-8gen2, snapdragon-8gen3 (default) or snapdragon-8elite, or a SoC file")
    pr.add_argument("--prompt-len", type=int, required=True, help="prompt tokens to prefill")
    pr.add_argument("--decode", type=int, default=0, metavar="N", help="tokens to decode after it (default 0)")
    pr.add_argument("--batch", type=int, default=1, help="sequences decoded together (test-time scaling's Best-of-N)")
    pr.add_argument("--scheme", default="w8a8-shadow", help="quantization scheme (default w8a8-shadow, mllm-NPU's; "
                                                            "W4A16 as HeteroLLM and the TTS paper run it: q4_0)")
    pr.add_argument("--strategy", default="mllm-npu", help="mllm-npu (chunked NPU + CPU, default), hetero "
                                                           "(HeteroLLM's GPU + NPU row cuts), gpu, npu or cpu")
    pr.add_argument("--chunk", type=int, default=256, help="mllm-npu: chunk length (default 256)")
    pr.add_argument("--scheduler", default="ooo", choices=["in-order", "ooo"], help="mllm-npu: subgraph order")
    pr.add_argument("--sync", default="fast", choices=["fast", "conventional"],
                    help="a cross-lane sync: HeteroLLM's fast sync (default) or a conventional one")
    pr.add_argument("--experts-in-flash", action="store_true",
                    help="MoE decode: routed experts the buffer misses are read from flash (EdgeMoE)")
    pr.add_argument("--expert-hit-rate", type=float, default=None,
                    help="the expert buffer's hit rate (an expert profile's; default 0 with --experts-in-flash)")
    pr.add_argument("--ffn-sparsity", type=float, default=None,
                    help="dense decode: the share of FFN neurons active per token, their rows streamed (LLM in a "
                         "flash)")
    pr.add_argument("--ffn-reuse", type=float, default=0.0,
                    help="with --ffn-sparsity: the share of active neurons already in DRAM (the sliding window's)")
    pr.add_argument("--trace", help="write the predicted prefill and decode-step timelines here (Chrome JSON)")
    pr.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    pr.set_defaults(fn=cmd_predict)

    t = _cmd(sub, "trace", help="open a written trace as an offline timeline, or import a phone's trace",
             description="show: a trace edgeprobe wrote (run --trace, the demo's trace.json, Trace.save) as an "
                         "offline timeline HTML. import: a phone's trace recorded by another tool (llama.cpp's "
                         "Hexagon profile lines, Chrome/Perfetto JSON) into DIR/trace.json (Perfetto) and "
                         "DIR/timeline.html; with --model aligned to the model's template (the share of measured time "
                         "mapped is printed), with --fit a cost model fitted from it (for schedule/run --cost-model).")
    tk = t.add_subparsers(dest="action", required=True, metavar="{show,import}")
    ts = tk.add_parser("show", help="a written trace as an offline timeline HTML",
                       description="Write the timeline of a trace file (edgeprobe's JSON or the Chrome/Perfetto JSON "
                                   "of run --trace) as one self-contained HTML page.", formatter_class=_HelpFormatter)
    ts.add_argument("file", metavar="FILE", help="trace JSON (run --trace, the demo's trace.json, Trace.save)")
    ts.add_argument("--out", metavar="HTML", help="the page to write (default FILE with .html)")
    ts.add_argument("--process", help="a file of several devices (run --device A --device B): the one to show")
    ts.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ti = tk.add_parser("import", help="a phone's trace from another tool, as Perfetto JSON and a timeline",
                       description="Read a phone's trace recorded by another tool into DIR/trace.json (Perfetto) and "
                                   "DIR/timeline.html; every time in it is measured on that hardware.",
                       formatter_class=_HelpFormatter)
    ti.add_argument("file", metavar="FILE",
                    help="the trace: a log with llama.cpp Hexagon profile lines, or Chrome JSON")
    ti.add_argument("--format", default="auto", choices=["auto", *FORMATS],
                    help="the file's format (default auto: recognised from its contents)")
    ti.add_argument("--out", metavar="DIR", required=True, help="folder for trace.json and timeline.html")
    ti.add_argument("--mhz", type=float, help="the clock of a file timed in cycles that states none (a QNN optrace "
                    "without its _runtrace.json beside it); refused by formats that need no clock")
    ti.add_argument("--model", metavar="CONFIG|GGUF|HF_DIR",
                    help="align the ops to this model's template (a config.json is enough: HF's, or edgeprobe's "
                         "ModelConfig fields) and print the share of measured time aligned; writes DIR/aligned.json")
    ti.add_argument("--fit", metavar="OUT.json",
                    help="with --model: fit a cost model to the aligned ops and save it (schedule/run --cost-model)")
    ti.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    t.set_defaults(fn=cmd_trace)

    a = _cmd(sub, "agent", help="start a device agent here (same as python -m edgeprobe_agent)")
    a.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="address to listen on (default loopback; another address needs --curve-keys)")
    a.add_argument("--store", default=str(cache_root() / "agent-store"),
                   help="the agent's blob store (its flash; default <edgeprobe cache>/agent-store)")
    a.add_argument("--memory-budget", type=float, default=None, help="MB of blobs kept resident")
    a.add_argument("--curve-keys", help="folder with server.key_secret; required off loopback")
    a.add_argument("--lanes", help="comma-separated lanes to offer, e.g. cpu,npu (default: all this machine has)")
    a.add_argument("--npu-backend", default="numba", choices=["numba", "hvx"],
                   help="the npu lane's kernels: numba (NPU semantics) or hvx (Hexagon code under qemu-hexagon)")
    a.set_defaults(fn=cmd_agent)

    k = _cmd(sub, "kernels", help="check a backend's kernels against their numpy references")
    k.add_argument("action", choices=["check"])
    k.add_argument("--backend", default="numba", choices=["numba", "hvx", "opencl"],
                   help="numba: NPU semantics on this CPU; hvx: Hexagon v67 HVX code under qemu-hexagon; "
                        "opencl: the gpu lane")
    k.add_argument("--seed", type=int, default=0, help="random cases' seed")
    k.add_argument("--json", action="store_true", help="print one JSON object: {kernels: {name: {cases, bit_exact, "
                                                       "max_abs_err}}, ok}")
    k.set_defaults(fn=cmd_kernels)

    c = _cmd(sub, "cache", help="list the prepared-model cache's entries, current or stale; prune the stale ones",
             description="The prepared-model cache ($EDGEPROBE_PREPARED_CACHE, else ~/.cache/edgeprobe/prepared): "
                         "list its entries (model, scheme, size, modified, current or stale: prepared under other "
                         "source) or prune them (the stale ones, or --all); entries being written are left alone.")
    ck = c.add_subparsers(dest="action", required=True, metavar="{list,prune}")
    cl = ck.add_parser("list", help="every entry: model, scheme, size, modified, current or stale",
                       description="List every entry of the prepared-model cache: model, scheme, bytes, last "
                                   "modified, and whether it is current or stale (and why).",
                       formatter_class=_HelpFormatter)
    cl.add_argument("--json", action="store_true", help="print one JSON object: {root, code_version, entries, bytes, "
                                                        "stale_bytes}")
    cp = ck.add_parser("prune", help="remove the stale entries (or --all); prints what and the bytes freed",
                       description="Remove the stale entries of the prepared-model cache (or all of them with --all) "
                                   "and print what was removed and the bytes freed; a temporary entry modified "
                                   "within the hour may be being written and is never removed.",
                       formatter_class=_HelpFormatter)
    cp.add_argument("--all", action="store_true", help="remove current entries too")
    cp.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    cp.add_argument("--json", action="store_true", help="print one JSON object: {root, dry_run, all, removed, "
                                                        "bytes_freed, bytes}")
    c.set_defaults(fn=cmd_cache)

    d = _cmd(sub, "demo", help="the main job: profile, quantize, schedule, run on a local agent, report")
    d.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    d.add_argument("--out", default="out", help="folder for report.html, trace.json, summary.json (and .cache/)")
    d.add_argument("--prompt-len", type=int, default=1024, help="prompt of the scheduled prefill")
    d.add_argument("--chunk", type=int, default=256, help="chunk length of the scheduled prefill")
    d.add_argument("--profile-tokens", type=int, default=8192, help="training-corpus tokens profiled for outliers")
    d.add_argument("--max-windows", type=int, default=8, help="held-out windows of 512 for the perplexity")
    d.add_argument("--repeats", type=int, default=2, help="runs per scheduler on the agent; the best is reported")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(fn=cmd_demo)
    return ap

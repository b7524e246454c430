"""`edgeprobe predict`: what a phone should give for a model, prefill and decode, from its config alone."""
from __future__ import annotations

import json


def _table(p) -> list[str]:
    d = p.decode_step
    lines = [f"{p.model} on {p.soc} ({p.strategy}, {p.scheme}; priced from {p.priced_from})",
             f"  prefill {p.prompt_len} tokens" + (f" in chunks of {p.chunk}" if p.chunk < p.prompt_len else "") +
             f": {p.prefill_ms:.1f} ms = {p.prefill_tok_s:.1f} tok/s, {p.prefill.bound}-bound "
             f"({_shares(p.prefill.shares)}); busy {_busy(p.prefill.lanes)}"]
    if d is not None:
        batch = f", {p.decode_tok_s_batch:.1f} tok/s for the batch of {p.batch}" if p.batch > 1 else ""
        lines.append(f"  decode: {d.ms:.2f} ms a step = {p.decode_tok_s:.2f} tok/s a sequence{batch}, "
                     f"{d.bound}-bound ({_shares(d.shares)}); busy {_busy(d.lanes)}")
    lines += [f"  note: {n}" for n in p.notes]
    return lines


def _shares(s: dict) -> str:
    return ", ".join(f"{k} {v:.0f}%" for k, v in sorted(s.items(), key=lambda kv: -kv[1]))


def _busy(s: dict) -> str:
    return ", ".join(f"{k} {v:.0f}%" for k, v in s.items())


def cmd_predict(args) -> int:
    from ..schedule.predict import predict

    p = predict(args.model, args.soc, args.prompt_len, args.decode, args.batch, args.scheme, args.strategy,
                args.chunk, args.scheduler, expert_hit_rate=args.expert_hit_rate,
                experts_in_flash=args.experts_in_flash, ffn_sparsity=args.ffn_sparsity, ffn_reuse=args.ffn_reuse,
                sync=args.sync)
    if args.trace:
        from ..trace import write_chrome_json

        traces = {"prefill": p.prefill.trace, **({"decode step": p.decode_step.trace} if p.decode_step else {})}
        write_chrome_json(args.trace, traces)
    if args.json:
        print(json.dumps(p.to_json()))
    else:
        print("\n".join(_table(p)))
    return 0

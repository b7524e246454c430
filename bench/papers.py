"""The papers' own phone results against edgeprobe's predictions: every row of tests/data/papers/phone_results.json
predicted from its model's config on the SoC's roofline (schedule.soc), with the median and worst |error| over the
rows predicted and why each other row is not. Nothing is measured here, so nothing depends on this machine.

    python bench/papers.py              # the table
    python bench/papers.py --markdown   # the table as docs/predict.md holds it
"""
from __future__ import annotations

import argparse


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.2f}" if v < 10 else f"{v:,.1f}"


UNIT = {"prefill_tok_s": "tok/s prefill", "decode_tok_s": "tok/s decode", "npu_ms": "ms of NPU",
        "e2e_s": "s end to end"}


def rows_md(rows: list[dict]) -> list[str]:
    out = ["| row | paper, where | model | strategy, scheme | tokens | paper | edgeprobe | error | bound |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = f"{r['prompt_len']}" + (f" + {r['decode']}" if r.get("decode") else "")
        paper = ("> " if r.get("bound") == "lower" else "") + f"{_fmt(r['value'])} {UNIT[r['metric']]}"
        if "error" in r:
            pred, err, bound = _fmt(r["predicted"]), f"{100 * r['error']:+.0f}%", r["bound_by"]
        else:
            alone = f"; prefill alone {r['prefill_alone_s']:.1f} s" if "prefill_alone_s" in r else ""
            pred, err, bound = "not predicted", f"{r['why']}{alone}", ""
        out.append(f"| `{r['id']}` | {r['paper']} {r['where']} | {r['model']} | {r['strategy']}, {r['scheme']} | "
                   f"{tokens} | {paper} | {pred} | {err} | {bound} |")
    return out


def summary_md(s: dict) -> str:
    return (f"{s['predicted']} of {s['rows']} rows predicted: median |error| {100 * s['median_abs_error']:.1f}%, "
            f"worst {100 * s['worst_abs_error']:.1f}% (`{s['worst']}`), every row within "
            f"{s['max_ratio']:.2f}x" + (" (all within 2x)" if s["within_2x"] else " (NOT all within 2x)"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the markdown table of docs/predict.md")
    args = ap.parse_args()
    from edgeprobe.schedule import papers

    rows = papers.check()
    s = papers.summary(rows)
    if args.markdown:
        print("\n".join(rows_md(rows)))
        print()
        print(summary_md(s))
        return
    w = max(len(r["id"]) for r in rows)
    for r in rows:
        if "error" in r:
            print(f"{r['id']:<{w}}  {r['metric']:<14} paper {r['value']:>9.2f}  edgeprobe {r['predicted']:>9.2f}  "
                  f"{100 * r['error']:+6.1f}%  {r['bound_by']}-bound")
        else:
            print(f"{r['id']:<{w}}  {r['metric']:<14} paper {r['value']:>9.2f}  not predicted: {r['why']}")
    print(summary_md(s))


if __name__ == "__main__":
    main()

"""The papers' own phone results against edgeprobe's predictions (schedule.predict over schedule.soc).

`check()` reads the table (tests/data/papers/phone_results.json: every end-to-end phone result of the five papers
that states an absolute number, its quote, and the setting it was measured in), predicts each row from the model's
real config (tests/data/configs/<model>/config.json) and returns the rows with their predictions and errors;
`summary()` gives the median and worst |error| over the rows predicted. A row that cannot be predicted (a component
measurement the SoC file uses as a parameter, an end-to-end time whose decode length the paper does not state)
carries its reason instead. The SoC files' numbers come from component measurements only, so this stays a test.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .graph import ScheduleError

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
TABLE = DATA / "papers" / "phone_results.json"
CONFIGS = DATA / "configs"
FORMAT = "edgeprobe-phone-results"


def load(path=TABLE) -> list[dict]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ScheduleError(f"{path}: not a readable table of phone results ({e})") from None
    if doc.get("format") != FORMAT:
        raise ScheduleError(f"{path}: not an {FORMAT} file")
    return doc["rows"]


def predict_row(row: dict, configs=CONFIGS, soc=None):
    """The Prediction of one row's setting (its model's config, SoC, strategy, scheme, lengths)."""
    from .predict import predict

    return predict(Path(configs) / row["model"] / "config.json", soc or row["soc"], row["prompt_len"],
                   row.get("decode", 0), row.get("batch", 1), row["scheme"], row["strategy"],
                   sync=row.get("sync", "fast"))


def _value(p, metric: str) -> float:
    return {"prefill_tok_s": p.prefill_tok_s, "decode_tok_s": p.decode_tok_s, "prefill_ms": p.prefill_ms}[metric]


def check(path=TABLE, configs=CONFIGS) -> list[dict]:
    """Each row with `predicted` and `error` ((predicted - paper) / paper), or `why` it is not predicted (and,
    for an end-to-end time, the prefill alone predicted where its model's config is here)."""
    out = []
    for row in load(path):
        r = dict(row)
        if row.get("not_predicted"):
            r["why"] = row["not_predicted"]
            if row["metric"] == "e2e_s" and (Path(configs) / row["model"] / "config.json").is_file():
                r["prefill_alone_s"] = predict_row(row, configs).prefill_ms / 1e3
            out.append(r)
            continue
        p = predict_row(row, configs)
        r["predicted"] = _value(p, row["metric"])
        r["error"] = (r["predicted"] - row["value"]) / row["value"]
        r["bound_by"] = p.decode_step.bound if row["metric"] == "decode_tok_s" else p.prefill.bound
        out.append(r)
    return out


def summary(rows: list[dict]) -> dict:
    """{rows, predicted, median_abs_error, worst_abs_error, worst, within_2x}: over the rows predicted."""
    errs = [(abs(r["error"]), r["id"]) for r in rows if "error" in r]
    if not errs:
        raise ScheduleError("no row of the table could be predicted")
    worst = max(errs)
    ratio = [max(r["predicted"] / r["value"], r["value"] / r["predicted"]) for r in rows if "error" in r]
    return {"rows": len(rows), "predicted": len(errs), "median_abs_error": statistics.median(e for e, _ in errs),
            "worst_abs_error": worst[0], "worst": worst[1], "within_2x": all(x <= 2.0 for x in ratio),
            "max_ratio": max(ratio) if ratio else math.nan}

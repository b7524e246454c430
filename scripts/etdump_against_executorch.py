"""edgeprobe's ETDump reader against ExecuTorch's own deserializer, on one file (default: the test fixture).

edgeprobe reads `.etdp` files without the executorch package (an 18.9 MB wheel that brings torch, torchao,
coremltools, scikit-learn and hydra). This checks, where executorch is installed, that both read the same profile
events: per run its name and bundled input index; per event its run, position, name, start and end ticks, chain
index, instruction id and delegate debug id. Exit 0 when equal, 1 with the first differences.

    python scripts/etdump_against_executorch.py [FILE.etdp]

It needs a Python where executorch and edgeprobe both import, e.g. a side environment: `python3 -m venv /tmp/etv &&
/tmp/etv/bin/pip install executorch -e .` (executorch brings torch). On 2026-11-28 executorch 1.5.1, installed with
--no-deps beside this project's .venv packages (torch 2.13 CPU) plus ruamel.yaml, flatbuffers and tabulate, read the
fixture's 31 events exactly as edgeprobe does.
"""
from __future__ import annotations

import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests/data/foreign/executorch_etdump/devtools_tutorial.etdp"


def main(argv: list[str]) -> int:
    try:
        from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc
    except ImportError as e:
        sys.exit(f"executorch is not importable here ({e}); see this script's docstring for a side environment")
    from edgeprobe.foreign import executorch_etdump

    path = Path(argv[0]) if argv else FIXTURE
    et = deserialize_from_etdump_flatcc(path.read_bytes())
    events, meta = executorch_etdump.read(path)
    theirs_runs = [{"name": r.name, "bundled_input_index": r.bundled_input_index} for r in et.run_data]
    theirs, skipped = [], 0
    for r, run in enumerate(et.run_data):
        for k, ev in enumerate(run.events):
            pe = ev.profile_event
            if pe is None:
                skipped += 1
                continue
            did = pe.delegate_debug_id_str or (pe.delegate_debug_id_int if pe.delegate_debug_id_int != -1 else None)
            theirs.append((r, k, pe.name, int(pe.start_time), int(pe.end_time), pe.chain_index, pe.instruction_id,
                           did))
    ours = [(e["run"], e["record"], e["name"], e["start_ticks"], e["end_ticks"], e["chain_index"],
             e["instruction_id"], e.get("delegate_debug_id")) for e in events]
    diffs = [(a, b) for a, b in zip(theirs, ours) if a != b]
    same = theirs == ours and theirs_runs == meta["runs"] and skipped == meta["skipped_events"]
    print(f"{path.name}: ExecuTorch schema version {et.version}, {len(et.run_data)} runs, {len(theirs)} profile events "
          f"({skipped} others); edgeprobe {len(ours)} events ({meta['skipped_events']} others): "
          f"{'the same, field for field' if same else 'DIFFERENT'}")
    for a, b in diffs[:5]:
        print(f"  executorch {a}\n  edgeprobe  {b}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python
"""Read a routing decision log (``[router] decision_log``, ``benchmarks/routing.py --decision-log``):
how far each worker's TTFT estimates were from what its requests measured, how its prefill rate
fit moved, and every decision that left the longest prefix match for another worker (a cold copy)
with the options it weighed and the TTFT that followed.

    python benchmarks/routing_decisions.py LOG.jsonl [LOG.jsonl ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(decision records in order, measured TTFT by request id). A request routed twice (KV
    admission re-routes it) keeps its last decision: that is where it ran."""
    decisions: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, float] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec["kind"] == "decision":
            decisions.pop(rec["id"], None)  # re-inserted: ordered by its last decision
            decisions[rec["id"]] = rec
        elif rec["kind"] == "ttft":
            ttfts[rec["id"]] = rec["ttft_s"]
    return list(decisions.values()), ttfts


def summarize(path: str | Path) -> dict[str, Any]:
    """Per worker: decisions, measured/estimated TTFT quantiles, the prefill fit first and last;
    and the cold copies."""
    decisions, ttfts = load(path)
    per_worker: dict[str, dict[str, Any]] = {}
    copies = []
    for d in decisions:
        w = per_worker.setdefault(d["first"], {"decisions": 0, "ratios": [], "prefill_fit": []})
        w["decisions"] += 1
        measured, estimated = ttfts.get(d["id"]), d.get("estimated_ttft_s")
        if measured is not None and estimated:
            w["ratios"].append(measured / estimated)
        for view in d["workers"]:
            fits = per_worker.setdefault(view["id"], {"decisions": 0, "ratios": [], "prefill_fit": []})["prefill_fit"]
            fit = view["prefill_fit"]
            if fit is not None and (not fits or fits[-1] != list(fit)):
                fits.append(list(fit))
        longest = max(v["matched"] for v in d["workers"])
        if longest and d["matched_blocks"] < longest:
            holder = max(d["workers"], key=lambda v: v["matched"])
            copies.append({"id": d["id"], "t": d["t"], "reason": d["reason"], "to": d["first"],
                           "matched": d["matched_blocks"], "holder": holder["id"], "holder_matched": longest,
                           "holder_pending_prefill": holder["pending_prefill"], "holder_running": holder["running"],
                           "holder_prefill_fit": holder["prefill_fit"], "estimated_ttft_s": d["estimated_ttft_s"],
                           "measured_ttft_s": measured, "prompt_len": d["prompt_len"],
                           "options": sorted(d["options"], key=lambda o: o[2])[:4]})
    workers = {}
    for wid, w in sorted(per_worker.items()):
        r = sorted(w["ratios"])
        workers[wid] = {"decisions": w["decisions"], "measured_over_estimated": _quantiles(r),
                        "prefill_fit_first": w["prefill_fit"][0] if w["prefill_fit"] else None,
                        "prefill_fit_last": w["prefill_fit"][-1] if w["prefill_fit"] else None,
                        "prefill_fit_changes": len(w["prefill_fit"])}
    reasons: dict[str, int] = {}
    for d in decisions:
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
    return {"log": str(path), "decisions": len(decisions), "with_ttft": sum(d["id"] in ttfts for d in decisions),
            "reasons": reasons, "by_kind": by_kind(decisions, ttfts), "workers": workers, "copies": copies}


def by_kind(decisions: list[dict[str, Any]], ttfts: dict[str, float], tail_tokens: int = 64) -> dict[str, Any]:
    """Measured against estimated TTFT by what the request asked of its worker: a ``tail`` (at most
    ``tail_tokens`` uncached) or a ``long`` prompt, ``/queue`` where prompt tokens were queued there
    already, ``local `` where a decode worker prefilled it (its steps decode its running sequences
    too). The rate fits show in the long prompts and the queues; most requests are tails."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for d in decisions:
        measured, estimated = ttfts.get(d["id"]), d.get("estimated_ttft_s")
        if measured is None or not estimated:
            continue
        first = next(w for w in d["workers"] if w["id"] == d["first"])
        uncached = d["prompt_len"] - d["matched_blocks"] * d.get("block_size", 16)
        kind = (("local " if first["role"] == "decode" else "") + ("tail" if uncached <= tail_tokens else "long")
                + ("/queue" if first["pending_prefill"] > 0 else ""))
        kinds.setdefault(kind, []).append((measured, estimated))
    return {k: {"n": len(v), "measured_p50_s": round(statistics.median(m for m, _ in v), 4),
                "estimated_p50_s": round(statistics.median(e for _, e in v), 4),
                "measured_over_estimated": _quantiles(sorted(m / e for m, e in v))}
            for k, v in sorted(kinds.items())}


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    qs = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"p10": round(qs[0], 3), "p50": round(statistics.median(values), 3), "p90": round(qs[-1], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json", default=None, help="write the summaries here")
    args = ap.parse_args(argv)
    summaries = [summarize(p) for p in args.logs]
    for s in summaries:
        print(f"{s['log']}: {s['decisions']} decisions ({s['with_ttft']} with a TTFT), reasons {s['reasons']}")
        for kind, k in s["by_kind"].items():
            print(f"  {kind}: {k['n']} requests, TTFT p50 measured {k['measured_p50_s'] * 1e3:.0f} ms, estimated "
                  f"{k['estimated_p50_s'] * 1e3:.0f} ms, measured/estimated {k['measured_over_estimated']}")
        for wid, w in s["workers"].items():
            fit = w["prefill_fit_last"]
            fit_text = f"{fit[0] * 1e3:.1f} ms + {fit[1] * 1e3:.3f} ms/token" if fit else "-"
            print(f"  {wid}: {w['decisions']} routed, measured/estimated TTFT {w['measured_over_estimated']}, "
                  f"prefill fit {fit_text} ({w['prefill_fit_changes']} fits)")
        for c in s["copies"]:
            print(f"  copy {c['id']} -> {c['to']} ({c['reason']}): held {c['holder_matched']} blocks on "
                  f"{c['holder']} (pending {c['holder_pending_prefill']}, running {c['holder_running']}, "
                  f"fit {c['holder_prefill_fit']}); TTFT est {c['estimated_ttft_s']:.3f} s, "
                  f"measured {c['measured_ttft_s']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bench's own judgement, free of processes so ``tests/unit`` can check it.

A figure is PASS, FAIL or n/a. n/a is only for what this machine truly lacks (no native-bf16
question to ask where bf16 is native, no GPU); anything else that kept a figure from being
measured (an exception, a side that did not start, too few reps) is a FAIL with its reason.
A ratio is the median of its interleaved reps, shown with their min-max, and passes only when
the median meets the goal. A side whose outputs differ from the baseline's (text or token
totals) did other work, so its figure fails whatever its speed.
"""

import statistics
import traceback

PASS, FAIL, NA = "PASS", "FAIL", "n/a"
MIN_REPS = 5


def spread(values) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def output_mismatch(side: str, reference: dict, got: dict) -> str | None:
    """Why ``got`` is not the same work as ``reference`` (each: {"texts": [...], "tokens": int}), or None."""
    ref_texts, texts = reference["texts"], got["texts"]
    if got["tokens"] != reference["tokens"]:
        return f"{side} generated {got['tokens']} tokens, the baseline {reference['tokens']}"
    if len(texts) != len(ref_texts):
        return f"{side} returned {len(texts)} outputs, the baseline {len(ref_texts)}"
    differ = [i for i, (a, b) in enumerate(zip(ref_texts, texts, strict=True)) if a != b]
    if differ:
        i = differ[0]
        return (f"{side}: {len(differ)}/{len(texts)} texts differ from the baseline's "
                f"(#{i}: {texts[i][:40]!r} vs {ref_texts[i][:40]!r})")
    return None


class Table:
    def __init__(self):
        self.rows: list[dict] = []
        self.info: list[str] = []

    def has(self, fid: str) -> bool:
        return any(r["id"] == fid for r in self.rows)

    def add(self, fid, name, service, baseline, value, goal, ok: bool, unit="", details=None,
            reps=None, reason: str | None = None) -> dict:
        """One measured figure. ``reps``: its per-rep values (the median is ``value``), shown as min-max.
        ``reason`` (why it failed besides its value) makes it FAIL whatever ``ok`` says."""
        if ok is None:
            raise ValueError(f"{fid}: a figure needs a verdict (PASS or FAIL); put observations in info()")
        status = PASS if ok and reason is None else FAIL
        if reason is None and not ok:
            reason = f"{_fmt(value, unit)} misses the goal {goal}"
        row = {"id": fid, "figure": name, "service": service, "baseline": baseline, "value": value,
               "unit": unit, "goal": goal, "status": status, "reason": reason,
               "reps": list(reps) if reps is not None else None, "details": details or {}}
        self.rows.append(row)
        return row

    def add_reps(self, fid, name, goal, meets, reps, service="", baseline="", unit="", details=None,
                 problems=(), min_reps: int = MIN_REPS) -> dict:
        """A figure judged on the median of its reps: PASS only when the median ``meets`` the goal,
        there were ``min_reps`` reps, and nothing in ``problems`` (e.g. different outputs)."""
        values = [v for v in reps if v is not None]
        problems = [p for p in problems if p]
        if len(values) < min_reps:
            problems.append(f"{len(values)} reps measured, at least {min_reps} needed")
        s = spread(values)
        value = s[0] if s else None
        ok = s is not None and bool(meets(value))
        reason = "; ".join(problems) or None
        return self.add(fid, name, service, baseline, value, goal, ok, unit=unit, details=details,
                        reps=values, reason=reason)

    def fail(self, fid, name, goal, reason: str, details=None) -> dict:
        """Not measured for a reason that is the service's or the bench's: a failure."""
        row = {"id": fid, "figure": name, "service": "-", "baseline": "-", "value": None, "unit": "",
               "goal": goal, "status": FAIL, "reason": reason, "reps": None, "details": details or {}}
        self.rows.append(row)
        return row

    def na(self, fid, name, goal, reason: str, lacking: bool) -> dict:
        """n/a only when the machine truly lacks what the figure needs (``lacking``); otherwise FAIL."""
        if not lacking:
            return self.fail(fid, name, goal, f"n/a: {reason}")
        row = self.fail(fid, name, goal, reason)
        row["status"] = NA
        return row

    def note(self, text: str) -> None:
        """An observation without a goal, printed under the table (never a figure)."""
        self.info.append(text)

    def failures(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == FAIL]

    def exit_code(self) -> int:
        return 1 if self.failures() or not self.rows else 0

    def render(self) -> str:
        head = ["ID", "Figure", "Service", "Baseline", "Result (median, min-max)", "Goal", "Status"]
        lines = []
        for r in self.rows:
            result = _fmt(r["value"], r["unit"]) if r["value"] is not None else "-"
            if r["reps"] and len(r["reps"]) > 1:
                result += f" ({_fmt(min(r['reps']), '')}-{_fmt(max(r['reps']), '')}, {len(r['reps'])} reps)"
            lines.append([r["id"], r["figure"], str(r["service"]), str(r["baseline"]), result, r["goal"],
                          r["status"]])
        if not lines:
            return "no figure was measured"
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
        out += [fmt.format(*row) for row in lines]
        out += [f"  {r['id']} {r['status']}: {' '.join(r['reason'].split())}" for r in self.rows if r["reason"]]
        out += [f"  info: {line}" for line in self.info]
        return "\n".join(out)


def guarded(table: Table, figures: list[tuple[str, str, str]], fn, log=print) -> None:
    """Run ``fn``; every figure in ``figures`` ((id, name, goal)) it did not put in the table is a
    FAIL row: an exception names itself, a phase that failed never collapses its rows into one."""
    reason = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one broken figure must not hide the others
        traceback.print_exc()
        reason = reason_of(exc)
    for fid, name, goal in figures:
        if not table.has(fid):
            why = reason or "not measured (the phase ended without it)"
            log(f"{fid}: FAIL: {why}")
            table.fail(fid, name, goal, why)


def reason_of(exc: BaseException) -> str:
    """One line: the exception's first line, and the last line of its text naming an error (a process
    that exited appends its log's tail, whose cause is near the end)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    cause = [line for line in lines[1:] if "Error" in line or "error" in line]
    return (head + (f" ... {cause[-1]}" if cause else ""))[:400]


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return (f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}") + unit
    return f"{value}{unit}"

"""The conformance report: one document, rendered to the terminal, markdown and HTML.

| section           | content                                                          |
|-------------------|------------------------------------------------------------------|
| header            | implementation, declared capabilities, versions, verdict, counts |
| contract v2       | each v2 feature (soft-cap, ALiBi, sinks, lse, Dv != Dk): declared or not, and how many checks were skipped for lacking it |
| quantized KV      | each KV format (fp8 e4m3fn / e5m2, int8): declared or not, the scale granularities declared, the checks skipped for the format or a granularity, and apart from each other the kernel's worst error (against the float64 oracle on the dequantized pages) and the error the quantization itself adds against the unquantized K/V (`quantization_error` in the JSON) |
| failures          | first: each failed check, the contract clause it points at, the message and its reproduction script (`repro/<check>.py`, conformance/repro.py) |
| areas             | passed / failed / skipped per check area                          |
| skipped           | each skip reason with its count (declarations, built-in-only checks) |
| errors            | worst abs / relative error and share of the allowance, per dtype and oracle |
| mutants           | built-in only: the seeded-mutant kill table (reports/mutants.json) and the mutmut score (reports/mutmut.json), when those runs have been made |
| checks            | every check with its result and clauses                          |
"""

from __future__ import annotations

import collections
import datetime
import html
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

from contract import GRANULARITIES, KV_DTYPES

from .capabilities import FEATURE_KEYS, features_in, kv_formats_in
from .clauses import describe

ROOT = Path(__file__).resolve().parent.parent
MUTANTS_JSON = ROOT / "reports" / "mutants.json"
MUTMUT_JSON = ROOT / "reports" / "mutmut.json"

AREAS = {
    "test_oracles": "oracles agree on the hand example and each other",
    "test_differential": "implementation vs the four oracles (tolerance rule)",
    "test_hand_fixtures": "hand fixtures: answers derived by hand",
    "test_hand_fixtures_v2": "hand-fixture loader: the contract-v2 keys",
    "test_score_pipeline": "contract v2: soft-cap, ALiBi, sinks, lse, Dv != Dk vs the oracles and invariants 6-9",
    "test_properties_v2": "hypothesis: random layouts with random score pipelines",
    "test_cascade": "cascade: a prefix and a suffix merged == one call",
    "test_merge_states": "merge_states: the formula, empty states, rejections",
    "test_oracles_v2": "contract v2 in the oracles: each feature vs float64, SDPA's reach, wrong pipelines fail",
    "test_oracles_v2_by_hand": "contract v2 in the float64 oracle: answers by hand, merge_states64",
    "test_conventions_v2": "lse and ALiBi conventions of other systems, converted",
    "test_invariants": "operator invariants 1, 2, 3, 6, 7, 8, 9",
    "test_rejections": "bad input: specific error, nothing written",
    "test_properties": "hypothesis: random layouts vs float64, rejections",
    "test_mixed_lengths": "mixed query lengths in one packed call (varlen kernels)",
    "test_edges": "edges: last page, full rows, tails, tiles past a page",
    "test_oracle_edges": "valid edge inputs (P = 0, all rows empty, wide tables) through every oracle",
    "test_schedules": "decode/prefill schedules, chunk and page edges",
    "test_golden_bits": "canonical arithmetic: pinned output bits",
    "test_fuzz_boundary": "fuzzed metadata: specific error or correct result",
    "test_runtime": "worker threads, GPU path",
    "test_build_paths": "build variants give the same bits",
    "test_pool": "page pool: allocation, reference counts, in-place writes",
    "test_cache": "paged cache: append, fork, copy-on-write, release",
    "test_serving_invariants": "serving invariants 1, 3, 4, 5, 10",
    "test_scheduler": "scheduler: admission, preemption, variants agree",
    "test_scheduler_invariants": "invariants 1-10 through the scheduler",
    "test_pool_machine": "hypothesis: pool and cache state machine",
    "test_scheduler_machine": "hypothesis: scheduler state machine",
    "test_model": "mlx-lm Qwen3 (f32, bf16) and gpt-oss (sinks, sliding layers): paged vs dense",
    "test_mutmut_kills": "mutmut survivors in the serving core, each killed by name",
    "test_mutmut_kills_contract": "mutmut survivors in validation, each killed by name",
    "test_plugin": "the --impl plug-in path: oracle passes, broken kernels fail",
    "test_repro": "a failed check as a standalone reproduction script",
    "test_formats": "format converters against each format's definition, round trips",
    "test_bridges": "torch / NumPy / MLX bridges; native-format kernels through the catalog",
    "test_declarations": "declarations narrow generation; memory-aware fixture skips",
    "test_peers": "real third-party kernels (peers/), smoke checks",
    "test_hand_fixtures_kv": "quantized KV hand fixtures: special codes, scales, answers derived by hand",
    "test_oracles_kv": "quantized KV in the oracles: every code decoded, oracles agree, quantization error",
    "test_kv_quant": "quantized KV in the built-in kernel: exact decode, invariants 6-9, rejections",
    "test_quantize_codes": "the quantizing write path's encoding: round trips, ties to even, saturation, NaN",
    "test_pool_quant": "quantized page pools: scales, in-place writes, rejections, attention over them",
    "test_kv_catalog": "quantized KV pages: each format x scale granularity vs the oracles, invariants 2, 6, 8, 9",
    "test_kv_plugin": "quantized KV through --impl: capability keys, torch fp8 dtypes, misreading kernels",
}


@dataclass
class Section:
    title: str
    text: list = field(default_factory=list)  # paragraphs
    table: tuple | None = None  # (header, rows)
    key: str = ""  # head | failures | areas | skipped | errors | ... (what the terminal shows)


@dataclass(frozen=True)
class Link:
    """A table cell that links a file (a path relative to the report directory)."""

    href: str

    def __str__(self) -> str:
        return self.href


@dataclass
class Doc:
    title: str
    verdict: str
    sections: list
    data: dict = field(default_factory=dict)  # the machine-readable record (conformance.json)


def _versions() -> str:
    import mlx.core as mx
    import numpy as np

    return (f"Python {platform.python_version()}, mlx {mx.__version__}, numpy {np.__version__}, "
            f"{platform.system()} {platform.machine()}")


def _area(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).stem


def build(impl, recorder, exitstatus) -> Doc:
    outcomes = list(recorder.outcomes.values())
    total = collections.Counter(o.outcome for o in outcomes)
    failed = total["failed"] > 0 or exitstatus not in (0, 5)
    verdict = "FAIL" if failed else "PASS"
    head = Section("Implementation", [
        f"**{impl.name}**",
        f"verdict: **{verdict}** - {total['passed']} passed, {total['failed']} failed, "
        f"{total['skipped']} skipped",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {_versions()}",
    ], (["capability", "declared"], [[k, str(v)] for k, v in impl.caps.summary().items()]), key="head")
    by_area = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_area[_area(o.nodeid)][o.outcome] += 1
    rank = {a: i for i, a in enumerate(AREAS)}  # AREAS order first, unknown areas after, by name
    areas = Section("Checks by area", table=(["area", "what", "passed", "failed", "skipped"], [
        [a, AREAS.get(a, ""), str(c["passed"]), str(c["failed"]), str(c["skipped"])]
        for a, c in sorted(by_area.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))]), key="areas")
    fails = [o for o in outcomes if o.outcome == "failed"]
    failures = Section("Failures", ["none"] if not fails else [REPRO_HELP], None if not fails else (
        ["check", "contract clause", "message", "reproduction"],
        [[o.nodeid, "; ".join(describe(c) for c in o.clauses) or "-", _one_line(o.message), _repro_cell(o)]
         for o in fails]), key="failures")
    reasons = collections.Counter(o.message for o in outcomes if o.outcome == "skipped")
    skipped = Section("Skipped (counted, never passed)", ["none"] if not reasons else [],
                      None if not reasons else (["reason", "checks"],
                                                [[_one_line(r), str(n)] for r, n in reasons.most_common()]),
                      key="skipped")
    errors = Section("Error against each oracle (worst over the checks, per dtype)", [
        "relative error = max |out - ref| / max |ref|; share = error / the tolerance rule's allowance "
        "(oracles/tolerance.py); `hand` = answers derived by hand."],
        (["dtype", "oracle", "max abs error", "max rel error", "worst share of allowance"],
         [[d, a, f"{e:.3e}", f"{r:.3e}", f"{s:.0%}"] for (d, a), (e, r, s) in sorted(recorder.errors.worst.items())]),
        key="errors")
    features = feature_record(impl, outcomes)
    declared = [f for f in FEATURE_KEYS if features[f]["declared"]]
    head.text.insert(2, "contract v2 features declared: " + (", ".join(declared) or "none")
                     + (" (the checks of the others are skipped with the reason)" if len(declared) < len(FEATURE_KEYS)
                        else ""))
    v2 = Section("Contract v2 features (REFERENCE.md 1b)", [
        "A feature the implementation does not declare is never checked: each check using it is skipped with "
        "the reason `not declared by ...: FEATURE (declare FEATURE=True in pagecheck_capabilities)`."],
        (["feature", "capability", "declared", "checks skipped for it"],
         [[FEATURE_TEXT[f], f, "yes" if features[f]["declared"] else "no", str(features[f]["skipped"])]
          for f in FEATURE_KEYS]), key="features")
    kv = kv_record(impl, outcomes, recorder.errors.kv)
    formats = impl.caps.kv_formats()
    head.text.insert(3, "KV formats declared: " + (", ".join(formats) or "none")
                     + (f" (scales: {', '.join(g for g in GRANULARITIES if g in impl.caps.kv_scales)})"
                        if formats else ""))
    kv_section = Section("Quantized KV pages (REFERENCE.md 1b)", [KV_HELP], (
        ["format", "declared", "scales declared", "skipped (format)", "skipped (granularity)", "checks measured",
         "kernel error (max abs)", "worst share of allowance", "quantization error (max abs)"],
        [[f, "yes" if r["declared"] else "no", ", ".join(r["scales"]) or "-", str(r["skipped"]),
          str(r["skipped_scales"]), str(r["checks"]), _num(r["kernel_error"]), _pct(r["share_of_allowance"]),
          _num(r["quantization_error"])] for f, r in kv.items()]), key="kv")
    sections = [head, failures, v2, areas, skipped, errors]  # failures first: what to fix, and how to rerun it
    sections.insert(sections.index(v2) + 1, kv_section)  # beside the other declared features
    if impl.builtin:
        sections += _mutant_sections()
    sections.append(Section("Every check", table=(["check", "result", "clauses", "detail"], [
        [o.nodeid, o.outcome, ", ".join(o.clauses) or "-", _one_line(o.message)[:160]] for o in outcomes])))
    data = {"implementation": impl.name, "builtin": impl.builtin, "capabilities": impl.caps.summary(),
            "verdict": verdict, "counts": dict(total), "features": features, "kv_formats": kv,
            "quantization_error": {f: r["quantization_error"] for f, r in kv.items()
                                   if r["quantization_error"] is not None},
            "checks": [{"id": o.nodeid, "outcome": o.outcome, "clauses": list(o.clauses), "message": o.message,
                        **({"repro": getattr(o, "repro", "") or None, "repro_note": getattr(o, "repro_note", "")}
                           if o.outcome == "failed" else {})}
                       for o in outcomes],
            "errors": [{"dtype": d, "oracle": a, "max_abs": e, "max_rel": r, "share_of_allowance": s}
                       for (d, a), (e, r, s) in sorted(recorder.errors.worst.items())]}
    return Doc("pagecheck conformance report", verdict, sections, data)


FEATURE_TEXT = {"softcap": "soft-cap", "alibi": "ALiBi slopes", "sinks": "attention sinks",
                "lse": "log-sum-exp output", "value_head_dim": "value head dim Dv != Dk"}


def feature_record(impl, outcomes) -> dict:
    """Per contract-v2 feature: declared or not, and the skipped checks whose reason names
    it as undeclared (a check lacking two features counts for both)."""
    skipped = collections.Counter(f for o in outcomes if o.outcome == "skipped" for f in features_in(o.message))
    return {f: {"declared": bool(getattr(impl.caps, f)), "skipped": skipped[f]} for f in FEATURE_KEYS}


KV_HELP = ("The kernel is judged on exact attention over the dequantized pages (`decode(code) * scale`); the "
           "error the 8-bit rounding of K/V itself adds, against attention over the unquantized K/V the check's "
           "case was quantized from, is no error of the kernel's and is shown apart (oracles.quantization_error), "
           "worst over the checks of each format. A format or granularity the implementation does not declare is "
           "never checked: each check using it is skipped with the reason `KV format F (declare kv_dtypes=[..., "
           "'F'] ...)` or `KV format F with v_scale per token (declare kv_scales=[..., 'token'] ...)`.")


def kv_record(impl, outcomes, measured: dict) -> dict:
    """Per KV format (contract.KV_DTYPES order): declared or not, the granularities declared,
    the skipped checks whose reason names the format (`skipped`) or one of its
    granularities (`skipped_scales`) as undeclared, and the checks that measured errors
    (`measured`: the ErrorLog's KVErrors per format): the kernel's worst error and share,
    and the quantization's own worst error (None where no check measured)."""
    skips = collections.Counter(kv_formats_in(o.message) for o in outcomes if o.outcome == "skipped")
    out = {}
    for f in KV_DTYPES:
        declared = f in impl.caps.kv_dtypes
        m = measured.get(f)
        out[f] = {"declared": declared,
                  "scales": [g for g in GRANULARITIES if g in impl.caps.kv_scales] if declared else [],
                  "skipped": skips[(f, "kv_dtypes")], "skipped_scales": skips[(f, "kv_scales")],
                  "checks": m.checks if m else 0, "kernel_error": m.kernel if m else None,
                  "share_of_allowance": m.share if m else None, "quantization_error": m.quantization if m else None}
    return out


def _num(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


REPRO_HELP = ("Each failed check that called the implementation has a standalone reproduction beside this "
              "report: `python repro/<check>.py` (the failing input, the call and the float64 oracle's answer; "
              "exit 1 while it fails, 0 once it passes; `--impl MODULE:ATTR` runs it on another kernel).")


def _repro_cell(o):
    path, note = getattr(o, "repro", ""), getattr(o, "repro_note", "")
    if path:
        return [Link(path), _one_line(note)] if note else Link(path)
    return _one_line(note or "none (no --report-dir)")


def _cell_text(cell, directory=None) -> str:
    """A cell as plain text (terminal): links as paths (under `directory` when given)."""
    if isinstance(cell, list):
        return " ".join(_cell_text(c, directory) for c in cell)
    if isinstance(cell, Link):
        return str(directory / cell.href) if directory is not None else cell.href
    return str(cell).replace("\\|", "|")


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _mutant_sections() -> list:
    out = []
    if MUTANTS_JSON.exists():
        data = json.loads(MUTANTS_JSON.read_text())
        out.append(Section("Seeded mutants (python -m mutants)", [
            f"{data['killed']}/{data['total']} killed, {data['survived']} survived ({MUTANTS_JSON.name}, "
            f"{datetime.datetime.fromtimestamp(MUTANTS_JSON.stat().st_mtime):%Y-%m-%d})"],
            (["mutant", "breaks", "status", "killed by", "s"],
             [[m["id"], _one_line(m.get("breaks", "")), m["status"], m.get("killed_by") or "-", str(m["seconds"])]
              for m in data["mutants"]])))
    else:
        out.append(Section("Seeded mutants", ["not run yet: `./pagecheck mutants --json reports/mutants.json`"]))
    if MUTMUT_JSON.exists():
        r = json.loads(MUTMUT_JSON.read_text())
        out.append(Section("mutmut (python -m mutants.mutmut_run)", [
            f"{r['total']} mutants: {r['killed']} killed, {r['timeouts']} timeouts, {r['equivalent']} recorded "
            f"equivalent, {len(r['survivors'])} survivors; score {r['score']:.1%}"]))
    return out


def terminal_lines(doc: Doc, directory: Path | None = None) -> list:
    """The summary, in the document's order (failures first); repro links as paths under
    `directory` (the report directory) when given."""
    lines = [doc.sections[0].text[0].strip("*")]
    for section in doc.sections[1:]:
        if section.key == "features":
            rows = section.table[1]
            line = "contract v2 features declared: " + (", ".join(f for _, f, d, _ in rows if d == "yes") or "none")
            missing = [f"{f} ({n} checks skipped)" for _, f, d, n in rows if d == "no"]
            lines.append(line + ("; not declared: " + ", ".join(missing) if missing else ""))
        elif section.key == "kv":
            lines += _kv_lines(section.table[1])
        elif section.key == "areas":
            lines.append("")
            lines.append(f"{'area':<26} {'':<52} {'passed':>6} {'failed':>6} {'skipped':>7}")
            for a, what, p, f, s in section.table[1]:
                lines.append(f"{a:<26} {what[:52]:<52} {p:>6} {f:>6} {s:>7}")
        elif section.key in ("failures", "skipped", "errors") and section.table and section.table[1]:
            lines.append("")
            lines.append(section.title + ":")
            lines.append("  " + " | ".join(section.table[0]))
            for row in section.table[1][:20]:
                lines.append("  " + " | ".join(
                    _cell_text(cell, directory) if isinstance(cell, (Link, list)) else _cell_text(cell)[:120]
                    for cell in row))
    lines += ["", f"verdict: {doc.verdict}"]
    return lines


def _kv_lines(rows) -> list:
    """The terminal's view of the KV section: what is declared, what was skipped, and per
    measured format the kernel's error beside the quantization's."""
    declared = [f"{f} ({scales})" for f, d, scales, *_ in rows if d == "yes"]
    line = "KV formats declared: " + (", ".join(declared) or "none")
    missing = [f"{f} ({n} checks skipped)" for f, d, _, n, *_ in rows if d == "no"]
    out = [line + ("; not declared: " + ", ".join(missing) if missing else "")]
    for f, _, _, _, grains, checks, kernel, _, quant in rows:
        if checks != "0" or grains != "0":
            out.append(f"  {f}: kernel error {kernel}, quantization error {quant} (vs unquantized K/V), "
                       f"{checks} checks measured, {grains} skipped for a scale granularity")
    return out


def markdown(doc: Doc) -> str:
    out = [f"# {doc.title}", ""]
    for s in doc.sections:
        out += [f"## {s.title}", ""]
        out += [p + "\n" for p in s.text]
        if s.table:
            header, rows = s.table
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "---|" * len(header))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("")
    return "\n".join(out)


def _md_cell(cell) -> str:
    if isinstance(cell, list):
        return " ".join(_md_cell(c) for c in cell)
    if isinstance(cell, Link):
        return f"[{cell.href}]({cell.href})"
    return str(cell)


def to_html(doc: Doc) -> str:
    def inner(text):
        if isinstance(text, list):
            return " ".join(inner(t) for t in text)
        if isinstance(text, Link):
            return f'<a href="{html.escape(text.href)}">{html.escape(text.href)}</a>'
        return html.escape(str(text).replace(chr(92) + '|', '|'))

    def cell(text, tag="td"):
        cls = f' class="{text}"' if isinstance(text, str) and text in (
            "passed", "failed", "skipped", "killed", "survived") else ""
        return f"<{tag}{cls}>{inner(text)}</{tag}>"

    body = [f"<h1>{html.escape(doc.title)}</h1>"]
    for s in doc.sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        body += [f"<p>{html.escape(p).replace('**', '')}</p>" for p in s.text]
        if s.table:
            header, rows = s.table
            body.append("<table><tr>" + "".join(cell(h, "th") for h in header) + "</tr>")
            body += ["<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows]
            body.append("</table>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}"
             ".failed,.survived{background:#fcc}.passed,.killed{background:#dfd}.skipped{background:#eee}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(doc.title)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def write(doc: Doc, directory: Path) -> list:
    directory.mkdir(parents=True, exist_ok=True)
    md, page, record = (directory / f"conformance.{ext}" for ext in ("md", "html", "json"))
    md.write_text(markdown(doc))
    page.write_text(to_html(doc))
    record.write_text(json.dumps(doc.data, indent=1, default=str) + "\n")
    return [md, page, record]

"""`python -m mutants.mutmut_run`: mutmut 3 over the Python serving core, in a scratch copy.

    python -m mutants.mutmut_run [--json PATH] [--max-children N] [--keep]
                                 [MUTANT_NAME_OR_GLOB ...] [--only-mutate GLOB ...]
                                 [--tests PATH ...]

mutmut writes its work dir `mutants/` at the project root, which is this package (the
seeded-mutant catalog), so it never runs in the checkout: the runner copies the tree
(`git ls-files -co --exclude-standard`, as `python -m mutants` does) into a fresh
temp dir without this package, runs `mutmut run` there with this interpreter (config:
`[tool.mutmut]` in pyproject.toml), then reads mutmut's results (the `.meta` files
that `mutmut results` prints) and reports total, killed, survived, timeouts,
suspicious and the score, with every survivor's file:line and change.

Survivors judged equivalent live in `mutants/mutmut_equivalent.toml`. An entry names
the mutated function and the exact changed line before and after; it applies to the
survivor with that change (the mutant number is kept for reference only, since it
shifts when the function changes). An entry that matches no survivor is reported as
stale. The score counts killed and timed-out mutants over all mutants less the skipped
and the recorded equivalents; the exit status is 0 when it is >= 90%.

`--only-mutate` narrows `only_mutate` in the copy's config (a trial on one file);
mutant names (or globs) run just those mutants, and the verdict then counts only them
(CI's smoke run: `.ci/run`). `--tests` narrows the test selection mutmut runs (its stats
and clean runs each take the whole selection, about 60 s, one process); the configured
selection then runs once in the copy under xdist first, so a copy where it would fail
(a test that cannot collect or pass without this package) still fails the run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from .runner import ROOT, _tracked_files, verdict_env

EQUIVALENTS = Path(__file__).with_name("mutmut_equivalent.toml")
THRESHOLD = 0.90
CATALOG_DIR = "mutants"  # this package; the copy leaves it out so mutmut can use the name
MUTMUT = [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())"]
DETECTED = ("killed", "timeout")
NOT_CHECKED = "not checked"


def make_copy(base: Path, only_mutate: list[str] | None) -> Path:
    tree = base / "tree"
    for f in _tracked_files(ROOT):
        if Path(f).parts[0] == CATALOG_DIR:
            continue
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    if only_mutate:
        _set_config_list(tree, "only_mutate", only_mutate)
    return tree


def _set_config_list(tree: Path, key: str, values: list[str]) -> None:
    """Replace the single-line list `key = [...]` of the copy's [tool.mutmut]."""
    config = tree / "pyproject.toml"
    # A function, not a template: json.dumps writes a non-ASCII glob as \uXXXX, which
    # re would read as a bad escape in a replacement string.
    line = f"{key} = " + json.dumps(values)
    text, n = re.subn(rf"(?m)^{key} = \[.*\]$", lambda _: line, config.read_text())
    if n != 1:
        raise SystemExit(f"pyproject.toml: no single-line {key} in [tool.mutmut] to narrow")
    config.write_text(text)


def _mutmut_config(tree: Path) -> dict:
    return tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["mutmut"]


def check_copy(tree: Path, workers: int) -> str | None:
    """The configured test selection, run in the copy as mutmut's clean run would (its
    extra pytest arguments, no PYTHONPATH), spread over `workers` xdist processes. Returns
    the last lines of the output when it fails, else None."""
    config = _mutmut_config(tree)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
           *config["pytest_add_cli_args"], *config["pytest_add_cli_args_test_selection"]]
    proc = subprocess.run(cmd, cwd=tree, env=_env(), capture_output=True, text=True)
    return None if proc.returncode == 0 else "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])


def narrow_tests(tree: Path, tests: list[str]) -> None:
    """mutmut runs only `tests` (the configured marker expression kept)."""
    selection = _mutmut_config(tree)["pytest_add_cli_args_test_selection"]
    marker = selection[selection.index("-m"):selection.index("-m") + 2] if "-m" in selection else []
    _set_config_list(tree, "pytest_add_cli_args_test_selection", [*tests, *marker])


def _env() -> dict:
    env = verdict_env(PAGECHECK_NUM_THREADS="1", HYPOTHESIS_PROFILE="ci")
    env.pop("PYTHONPATH", None)
    return env


def run_mutmut(tree: Path, max_children: int, names: list[str]) -> int:
    env = _env()
    cmd = MUTMUT + ["run", "--max-children", str(max_children), *names]
    print(f"$ cd {tree} && mutmut run --max-children {max_children} {' '.join(names)}", file=sys.stderr)
    return subprocess.run(cmd, cwd=tree, env=env, stdout=sys.stderr).returncode


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _changed_lines(diff: str) -> tuple[str, str, int]:
    """(original, mutated, line of the first change counted from the function's first line)
    of a `mutmut show` diff; lines are stripped and joined with newlines."""
    before, after, first, rel = [], [], None, 0
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            rel = int(re.match(r"@@ -(\d+)", line).group(1)) - 1
            continue
        if line.startswith("-"):
            first = rel if first is None else first
            before.append(line[1:].strip())
            rel += 1
        elif line.startswith("+"):
            first = rel if first is None else first
            after.append(line[1:].strip())
        else:
            rel += 1
    return "\n".join(before), "\n".join(after), first or 0


def _function_spans(source: str) -> dict[str, tuple[int, int]]:
    """'Class.method' / 'function' -> (first line incl. decorators, last line), 1-based."""
    spans = {}
    for node in ast.parse(source).body:
        members = [(node, "")] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
            [(m, node.name + ".") for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))] \
            if isinstance(node, ast.ClassDef) else []
        for fn, prefix in members:
            start = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
            spans[prefix + fn.name] = (start, fn.end_lineno)
    return spans


def collect(tree: Path) -> dict:
    """Every mutant's status, and for each one not detected its file, line and change."""
    with _cwd(tree):
        from mutmut.mutation.diff_apply import get_diff_for_mutant
        from mutmut.stats import status_by_exit_code
        from mutmut.utils.format_utils import orig_function_and_class_names_from_key

        mutants, spans = [], {}
        for meta in sorted(Path("mutants").rglob("*.py.meta")):
            path = meta.relative_to("mutants").as_posix()[: -len(".meta")]
            source = Path(path).read_text()
            spans[path] = _function_spans(source)
            lines = source.splitlines()
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                entry = {"name": name, "file": path, "status": status_by_exit_code[code]}
                if entry["status"] not in DETECTED:
                    func, cls = orig_function_and_class_names_from_key(name)
                    qual = f"{cls}.{func}" if cls else func
                    diff = get_diff_for_mutant(name, path=path)
                    original, mutated, rel = _changed_lines(diff)
                    start, end = spans[path].get(qual, (1, len(lines)))
                    line = start + rel
                    first = original.split("\n")[0]
                    if first and (line > end or lines[line - 1].strip() != first):
                        hits = [i for i in range(start, end + 1) if lines[i - 1].strip() == first]
                        line = hits[0] if hits else line
                    entry.update(function=qual, line=line, original=original, mutated=mutated, diff=diff)
                mutants.append(entry)
    return {"mutants": mutants}


def load_equivalents(path: Path = EQUIVALENTS) -> list[dict]:
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text()).get("equivalent", [])
    for e in entries:
        missing = {"mutant", "file", "function", "original", "mutated", "reason"} - set(e)
        if missing:
            raise SystemExit(f"{path.name}: entry {e.get('mutant', '?')} lacks {sorted(missing)}")
    return entries


def _matches(entry: dict, mutant: dict) -> bool:
    return (entry["file"], entry["function"], entry["original"].strip(), entry["mutated"].strip()) == \
        (mutant["file"], mutant.get("function"), mutant.get("original"), mutant.get("mutated"))


def report(mutants: list[dict], equivalents: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for m in mutants:
        counts[m["status"]] = counts.get(m["status"], 0) + 1
    undetected = [m for m in mutants if m["status"] not in DETECTED]
    used = set()
    for m in undetected:
        for i, e in enumerate(equivalents):
            if _matches(e, m):
                m["equivalent"] = e["reason"]
                used.add(i)
                break
    equivalent = [m for m in undetected if "equivalent" in m]
    total, skipped = len(mutants), counts.get("skipped", 0)
    detected = sum(counts.get(s, 0) for s in DETECTED)
    judged = total - skipped - len(equivalent)
    return {
        "total": total, "killed": counts.get("killed", 0), "survived": counts.get("survived", 0),
        "timeouts": counts.get("timeout", 0), "suspicious": counts.get("suspicious", 0),
        "no_tests": counts.get("no tests", 0), "skipped": skipped,
        "other": {k: v for k, v in counts.items()
                  if k not in ("killed", "survived", "timeout", "suspicious", "no tests", "skipped")},
        "equivalent": len(equivalent),
        "score_raw": round(detected / max(total - skipped, 1), 4),
        "score": round(detected / max(judged, 1), 4),
        "survivors": [{k: m[k] for k in ("name", "status", "file", "line", "function", "original", "mutated")}
                      for m in undetected if "equivalent" not in m],
        "equivalents": [{k: m[k] for k in ("name", "file", "line", "function", "original", "mutated", "equivalent")}
                        for m in equivalent],
        "stale_equivalents": [e["mutant"] for i, e in enumerate(equivalents) if i not in used],
    }


def smoke_passes(r: dict) -> bool:
    """A smoke run's verdict: every named mutant killed (or recorded equivalent). A
    timeout fails it, though the score counts timeouts as detected: the smoke's mutants
    fail in seconds, and a run where they time out (the fork server's threads, 2026-12-02)
    would score 100% while testing nothing."""
    return r["total"] > 0 and r["killed"] + r["equivalent"] == r["total"]


def print_report(r: dict, seconds: float) -> None:
    print(f"mutmut: {r['total']} mutants, {r['killed']} killed, {r['survived']} survived, "
          f"{r['timeouts']} timeouts, {r['suspicious']} suspicious, {r['no_tests']} without tests, "
          f"{r['skipped']} skipped" + "".join(f", {v} {k}" for k, v in r["other"].items()))
    print(f"equivalent (mutants/mutmut_equivalent.toml): {r['equivalent']}")
    for m in r["equivalents"]:
        print(f"  = {m['file']}:{m['line']} {m['function']}: {m['original']!r} -> {m['mutated']!r}")
    print(f"not killed, not equivalent: {len(r['survivors'])}")
    for m in r["survivors"]:
        print(f"  {m['status']:<10} {m['file']}:{m['line']} {m['function']}: {m['original']!r} -> "
              f"{m['mutated']!r}  [{m['name']}]")
    for name in r["stale_equivalents"]:
        print(f"  stale equivalent entry (matches no survivor): {name}")
    print(f"score {r['score']:.1%} (raw {r['score_raw']:.1%} before equivalents; need {THRESHOLD:.0%}) "
          f"in {seconds:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="mutmut 3 over impl/ in a scratch copy of the tree.")
    parser.add_argument("names", nargs="*", metavar="MUTANT", help="run only these mutants (names or globs)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutant workers (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    parser.add_argument("--only-mutate", nargs="+", metavar="GLOB", help="narrow [tool.mutmut] only_mutate")
    parser.add_argument("--tests", nargs="+", metavar="PATH",
                        help="narrow the tests mutmut runs (the whole selection is checked once in the copy first)")
    parser.add_argument("--smoke", action="store_true",
                        help="with MUTANT names: pass only if every one is killed (a timeout fails: these are "
                             "mutants that fail in seconds, so a timeout means the run itself is broken)")
    args = parser.parse_args(argv)
    if args.smoke and not args.names:
        parser.error("--smoke needs MUTANT names")
    # --tests takes every word after it: mutant names written there would reach mutmut's
    # stats run as test paths and fail it minutes later (2026-12-03).
    missing = [p for p in args.tests or () if not (ROOT / p).exists()]
    if missing:
        parser.error(f"--tests: no such test file or directory: {', '.join(missing)} "
                     "(mutant names go before --tests, which takes every word after it)")

    equivalents = load_equivalents()
    base = Path(tempfile.mkdtemp(prefix="pagecheck-mutmut-"))
    started = time.perf_counter()
    try:
        tree = make_copy(base, args.only_mutate)
        if args.tests:
            failed = check_copy(tree, args.max_children)
            if failed:
                print(f"the test selection fails in mutmut's copy (mutmut's clean run would):\n{failed}",
                      file=sys.stderr)
                return 2
            narrow_tests(tree, args.tests)
        rc = run_mutmut(tree, args.max_children, args.names)
        if rc:
            print(f"mutmut run failed (exit {rc})", file=sys.stderr)
            return 2
        mutants = collect(tree)["mutants"]
        if args.names:
            # A run of named mutants (a smoke run, as CI's) is judged on those alone: the
            # others are "not checked", not survivors. None checked is a failure, so a
            # glob that stopped matching cannot pass quietly.
            mutants = [m for m in mutants if m["status"] != NOT_CHECKED]
            if not mutants:
                print(f"no mutant matched {' '.join(args.names)}", file=sys.stderr)
                return 2
        result = report(mutants, equivalents)
    finally:
        if args.keep:
            print(f"scratch copy kept: {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    seconds = time.perf_counter() - started
    result["seconds"] = round(seconds, 1)
    if args.names:
        result["stale_equivalents"] = []  # the other mutants were not run: nothing to call stale
    print_report(result, seconds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    if args.smoke:
        ok = smoke_passes(result)
        print(f"smoke: {result['killed']} of {result['total']} named mutants killed"
              + ("" if ok else " (a timeout or survivor: the mutmut run is broken)"))
        return 0 if ok else 1
    return 0 if result["score"] >= THRESHOLD else 1


if __name__ == "__main__":
    sys.exit(main())

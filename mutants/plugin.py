"""The seeded-mutant catalog as pytest items, so pytest-xdist spreads a run over cores and hosts.

    python -m pytest -p mutants.plugin mutants/catalog -n 2 --mutants-json reports/mutants.json
    python -m pytest -p mutants.plugin mutants/catalog/kernel.toml -k window        # a few, one process
    python -m pytest -p mutants.plugin mutants/catalog -d \\
        --tx 4*ssh=HOST//python=CLONE/.venv/bin/python//chdir=CLONE --tx 2*popen  # other hosts too

Each `[[mutant]]` of a catalog file given on the command line is one item, named by its
id. The engine is `mutants.runner`'s: the process that runs an item (each xdist worker,
on whichever host) owns one `Worker` — a scratch copy of the tree it was started in,
with its own incremental build of the kernels — and judges the mutant there exactly as
`python -m mutants` does (its killers first, then the correctness suite, fail-fast). So
`-n`, `--tx` and `--dist` are xdist's own; a host in `--tx` needs a clone of the same
commit, set up (`./pagecheck setup`), at `chdir` (xdist checks that every worker
collected the same items, which catches a catalog that differs, not other code).

| outcome of an item | mutant status (runner) |
|---|---|
| passed | killed: `killed by` names the first failing test, a crash or a time-out |
| failed | survived (no test failed), invalid (it does not compile), its snippet is not in the tree exactly once, or the worker's baseline failed |
| skipped | not applicable here: it `needs` AMX tiles or triton this machine lacks |

Unless `--mutants-no-baseline`, a worker first checks that the unmutated copy passes the
killers of every collected mutant of an implementation and the correctness suite on it
(one baseline per worker and implementation). `--mutants-json` / `--mutants-markdown`
write the runner's report (`reports/mutants.json` feeds the conformance report's kill
table); the controller gathers every worker's results for them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from .catalog import Mutant, load_file, problems
from .runner import ROOT, Worker, _tracked_files, headline, lacking, markdown, not_applicable, summary

RESULT = "mutant"  # the user property that carries an item's result dict to the controller


def pytest_addoption(parser):
    group = parser.getgroup("mutants", "seeded mutants as items (mutants/plugin.py)")
    group.addoption("--mutants-json", metavar="PATH", help="write the runner's JSON report here")
    group.addoption("--mutants-markdown", metavar="PATH", help="write the runner's results table here")
    group.addoption("--mutants-no-baseline", action="store_true",
                    help="skip the workers' baseline (only right after a green run of the suite)")
    group.addoption("--mutants-keep", action="store_true", help="keep the workers' scratch copies")


def pytest_configure(config):
    config.pluginmanager.register(Results(config), "mutants-results")


def pytest_collect_file(parent, file_path):
    """A catalog file named on the command line, or one in a `catalog` directory named there."""
    if file_path.suffix == ".toml" and (parent.session.isinitpath(file_path) or file_path.parent.name == "catalog"):
        return CatalogFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(session, config, items):
    seen = {}
    for item in items:
        if isinstance(item, MutantItem):
            if item.mutant.id in seen:
                raise pytest.UsageError(f"mutant id {item.mutant.id} in {item.mutant.source} and {seen[item.mutant.id]}")
            seen[item.mutant.id] = item.mutant.source
    # Native mutants first: their builds are the slow part, so they spread over workers early.
    items.sort(key=lambda i: not (isinstance(i, MutantItem) and i.mutant.native))


class CatalogFile(pytest.File):
    def collect(self):
        for mutant in load_file(self.path):
            yield MutantItem.from_parent(self, name=mutant.id, mutant=mutant)


class NotKilled(Exception):
    """The suite did not notice the mutant (or it could not be judged)."""


class MutantItem(pytest.Item):
    def __init__(self, *, mutant: Mutant, **kwargs):
        super().__init__(**kwargs)
        self.mutant = mutant

    def runtest(self):
        m, engine = self.mutant, Engine.of(self.config)
        if m.needs and engine.lacking[m.needs]:
            skipped = not_applicable(m)
            self.user_properties.append((RESULT, skipped))
            pytest.skip(skipped["killed_by"])
        broken = problems([m], ROOT)
        if broken:
            self.user_properties.append((RESULT, {"id": m.id, "status": "catalog error", "killed_by": broken[0],
                                                  "breaks": m.breaks, "file": m.file, "seconds": 0.0}))
            raise NotKilled(broken[0])
        result = engine.judge(m, self.session.items)
        self.user_properties.append((RESULT, result))
        if result["status"] != "killed":
            raise NotKilled(f"{result['status']}: {result['killed_by'] or 'no test failed'} "
                            f"(it breaks: {m.breaks})")

    def repr_failure(self, excinfo, style=None):
        if excinfo.errisinstance(NotKilled):
            return f"mutant {self.mutant.id} ({self.mutant.file}) not killed: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"mutant {self.mutant.id}"


class Engine:
    """This process's worker: one scratch copy of the tree and its build, made on first use."""

    def __init__(self, config):
        self.config = config
        self.lacking = lacking()
        self.worker: Worker | None = None
        self.base: Path | None = None
        self.baseline: dict[str | None, str | None] = {}  # impl -> failing test or None

    @classmethod
    def of(cls, config) -> "Engine":
        if not hasattr(config, "_mutant_engine"):
            config._mutant_engine = cls(config)
            config.add_cleanup(config._mutant_engine.close)
        return config._mutant_engine

    def judge(self, mutant: Mutant, items) -> dict:
        worker = self._worker()
        if not self.config.getoption("mutants_no_baseline") and mutant.impl not in self.baseline:
            killers = sorted({k for i in items if isinstance(i, MutantItem) and i.mutant.impl == mutant.impl
                              for k in i.mutant.killers})
            self.baseline[mutant.impl] = worker.baseline(killers, mutant.impl)
        failing = self.baseline.get(mutant.impl)
        if failing:
            raise NotKilled(f"the unmutated tree fails {failing}: fix the suite before judging mutants")
        return worker.run(mutant)

    def _worker(self) -> Worker:
        if self.worker is None:
            # xdist workers on one host share its cores for their builds.
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
            cores = os.cpu_count() or 1
            index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
            self.base = Path(tempfile.mkdtemp(prefix="pagecheck-mutants-"))
            self.worker = Worker(index, self.base, _tracked_files(ROOT), max(1, cores // min(workers, cores)))
        return self.worker

    def close(self):
        if self.base is not None and not self.config.getoption("mutants_keep"):
            shutil.rmtree(self.base, ignore_errors=True)


class Results:
    """The controller's (or the single process's) collection of item results and reports."""

    def __init__(self, config):
        self.config, self.results, self.started = config, [], time.perf_counter()
        self.final: dict | None = None  # the report, made once at the session's end

    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if name == RESULT and report.when == "call":
                self.results.append(value)

    def report(self) -> dict:
        """As the runner's: a mutant whose snippet is not in the tree is a catalog error, not a result."""
        broken = [r["killed_by"] for r in self.results if r["status"] == "catalog error"]
        judged = [r for r in self.results if r["status"] != "catalog error"]
        return summary(judged, broken, time.perf_counter() - self.started)

    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workerinput") or not self.results:
            return  # an xdist worker: its results travel to the controller
        report = self.final = self.report()
        if self.config.getoption("mutants_json"):
            Path(self.config.getoption("mutants_json")).write_text(json.dumps(report, indent=2))
        if self.config.getoption("mutants_markdown"):
            Path(self.config.getoption("mutants_markdown")).write_text(markdown(report["mutants"]) + "\n")

    def pytest_terminal_summary(self, terminalreporter):  # after pytest_sessionfinish
        if self.final is not None:
            terminalreporter.write_line(headline(self.final))

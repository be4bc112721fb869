"""Structure figures of the package (issue 44): modules, the largest, import circles (counting
imports made inside functions, and module level only), imports made inside functions,
hasattr/getattr probes on drafters and caches, vocabulary checks. Static: nothing is imported.

    python benchmarks/structure.py [REPO] [-p: list the probes] [-v: list function imports]

Upward imports are checked by `lint-imports` against pyproject.toml's layers
(tests/test_import_layers.py)."""

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

root = Path(
    next((a for a in sys.argv[1:] if not a.startswith("-")), Path(__file__).resolve().parents[1])
)
MAP = {
    "edgespec": "edgespec",
    "models": "edgespec.models",
    "converters": "edgespec.converters",
    "apps": "edgespec.apps",
}
mods = {}
for top, pkg in MAP.items():
    for p in (root / top).rglob("*.py"):
        if "swift" in p.parts:
            continue
        rel = p.relative_to(root / top).with_suffix("")
        parts = [x for x in rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join([pkg] + parts)
        mods[name] = p


def resolve(mod, node, name):
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".")
            ispkg = mods[mod].name == "__init__.py"
            base = base if ispkg else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            tgt = ".".join(base + ([node.module] if node.module else []))
        else:
            tgt = node.module
        cands = [tgt + "." + name, tgt] if name else [tgt]
    else:
        cands = [name]
    for c in cands:
        while c:
            if c in mods:
                return c
            c = c.rpartition(".")[0]
    return None


edges_all = defaultdict(set)
edges_top = defaultdict(set)
infunc = 0
infunc_list = []
for m, p in mods.items():
    tree = ast.parse(p.read_text())
    parents = {}
    for n in ast.walk(tree):
        for c in ast.iter_child_nodes(n):
            parents[c] = n
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            # inside function?
            q = n
            fn = False
            tc = False
            while q in parents:
                q = parents[q]
                if isinstance(q, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = True
                if isinstance(q, ast.If) and "TYPE_CHECKING" in ast.unparse(q.test):
                    tc = True
            if tc:
                continue
            if fn:
                infunc += 1
                infunc_list.append((m, ast.unparse(n)))
            targets = {resolve(m, n, a.name) for a in n.names}
            if isinstance(n, ast.ImportFrom):
                # `from pkg import mod` runs pkg/__init__ first: an edge to the package too
                targets.add(resolve(m, n, ""))
            for t in targets:
                if t and t != m:
                    edges_all[m].add(t)
                    if not fn:
                        edges_top[m].add(t)


def sccs(edges):
    idx = {}
    low = {}
    st = []
    on = set()
    out = []
    c = [0]
    sys.setrecursionlimit(10000)

    def sc(v):
        idx[v] = low[v] = c[0]
        c[0] += 1
        st.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in idx:
                sc(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in mods:
        if v not in idx:
            sc(v)
    return out


# package-level circles ignoring imports of a package's own __init__ from a submodule of it
sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in mods.items()), reverse=True)
print("modules", len(mods))
print("largest", sizes[0], "over450:", [s for s in sizes if s[0] > 450])
ca = sccs(edges_all)
ct = sccs(edges_top)
print("circles (strongly connected groups) counting function imports:", len(ca))
for c in ca:
    print("   ", len(c), c if len(c) < 12 else c[:12] + ["..."])
print("circles module-level only:", len(ct))
for c in ct:
    print("   ", c)
print("imports inside functions:", infunc)
if "-v" in sys.argv:
    for x in infunc_list:
        print("   ", x)
# probes
probe = re.compile(
    r"(getattr|hasattr)\([^)]*?(drafter|tiny|mid|needs_features|\"sync\"|reads_verifier|bind_verifier_cache|\"fork\"|reuses_prefixes|prefix_reuse|hidden_at|span_kind|\"state\"|keep_hidden|expected_acceptance)"
)
n = 0
for m, p in mods.items():
    for i, line in enumerate(p.read_text().splitlines()):
        if probe.search(line) and "args" not in line.split("getattr(")[-1][:6]:
            n += 1
            if "-p" in sys.argv:
                print("   probe", m, i + 1, line.strip()[:110])
print("probes (hasattr/getattr on drafters and caches):", n)
vc = 0
for p in mods.values():
    t = p.read_text()
    for pat in (
        "def check_vocabulary",
        "def check_vocab_map",
        "def check_map_vocabulary",
        "def package_vocab_map",
        "def check_compatible",
    ):
        vc += t.count(pat)
    vc += len(re.findall(r"vocab_size\"?\]?\)? != |vocab_size != |vocab_size\)? != ", t))
print("vocabulary check definitions + inline vocab-size comparisons:", vc)
proj_infunc = sum(1 for m, s in infunc_list if re.search(r"\bedgespec\b|^from \.", s))
print("imports inside functions, of the project's own modules:", proj_infunc)
if "-g" in sys.argv:

    def grp(m):
        parts = m.split(".")
        if parts[1:2] in (["models"], ["converters"], ["apps"]):
            return ".".join(parts[:2])
        return ".".join(parts[:2])

    g = defaultdict(set)
    for a, bs in edges_all.items():
        for b in bs:
            if grp(a) != grp(b):
                g[grp(a)].add(grp(b))
    for a in sorted(g):
        print(a, "->", sorted(g[a]))

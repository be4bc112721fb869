"""Bounds on grammars checked before the grammar library sees them (pure Python, linear).

llguidance compiles recursively (a long `$ref` chain or rule chain overflows the native
stack) and some constructions cost time quadratic in their size (alternatives, enums), so
what a request may ask for is bounded here first: sizes, JSON nesting and `$ref` chain
depth, Lark/GBNF rule and alternative counts, enum sizes, counted repetitions of regexes.
A grammar over a bound raises GrammarLimitError (a ValueError: a 400 naming the limit).
What passes is then compiled in a separate process with a time bound
(edgespec.logits.structured.isolated), so a crash or a stall of the native code on an input
these checks let through costs that process, never the server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class GrammarLimitError(ValueError):
    """A grammar over one of GrammarLimits' bounds (the message names the bound)."""


@dataclass
class GrammarLimits:
    """What one response format may ask for. Defaults are far above what real schemas and
    grammars use (the 42-schema suite peaks at depth 6, 40 alternatives) and below
    what stalls or crashes the compiler (a 2,500-link `$ref` chain, 5,000 chained rules,
    60,000 alternatives: see docs/structured.md)."""

    max_bytes: int = 1_000_000  # the grammar text / the schema as JSON
    max_depth: int = 64  # JSON schema nesting (schemas inside schemas)
    max_ref_depth: int = 64  # the longest chain of $ref links followed one after another
    max_nodes: int = 50_000  # schemas in one JSON schema
    max_rules: int = 2_000  # Lark/GBNF rules
    # '|' of a grammar; anyOf/oneOf branches of a schema. Below llguidance's 2,000 items per
    # parser row (max_items_in_row), which a rule's alternatives fill once generation starts.
    max_alternatives: int = 1_500
    max_enum: int = 10_000  # enum values of a schema, all enums together
    max_regex_bytes: int = 20_000  # one regex (response_format regex, a schema's pattern)
    max_repetition: int = 100_000  # counted repetitions {n} of a regex, multiplied through nesting
    compile_timeout_s: float = 10.0  # compiling one grammar (for one tokenizer), in the isolated process
    isolate: bool = True  # compile in a separate process (a native crash cannot end this one)


LIMITS = GrammarLimits()


def _over(what: str, value: int | None, limit: int | float, field: str) -> GrammarLimitError:
    """The refusal, naming the bound (value None: counting stopped at the limit)."""
    is_ = "is over" if value is None else f"is {value}, over"
    return GrammarLimitError(f"response_format: {what} {is_} the limit of {limit} (GrammarLimits.{field})")


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Every keyword of JSON Schema (2020-12 and draft 7) and the OpenAPI/Pydantic annotations; a
# strict schema with another keyword is refused (its constraint could not be enforced).
KNOWN_KEYWORDS = frozenset("""
$schema $id $ref $defs definitions $comment $anchor $dynamicRef $dynamicAnchor $vocabulary $recursiveRef
$recursiveAnchor title description default examples deprecated readOnly writeOnly type enum const
properties patternProperties additionalProperties required propertyNames minProperties maxProperties
dependentRequired dependentSchemas dependencies unevaluatedProperties items prefixItems additionalItems
contains minContains maxContains minItems maxItems uniqueItems unevaluatedItems minLength maxLength pattern
format contentEncoding contentMediaType contentSchema minimum maximum exclusiveMinimum exclusiveMaximum
multipleOf allOf anyOf oneOf not if then else discriminator nullable example externalDocs xml
""".split())
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _subschemas(node: dict, path: str) -> Iterator[tuple[Any, str]]:
    for k in _SCHEMA_MAPS:
        m = node.get(k)
        if isinstance(m, dict):
            for name, sub in m.items():
                yield sub, f"{path}/{k}/{name}"
    for k in _SCHEMA_ONE:
        if k in node:
            yield node[k], f"{path}/{k}"
    for k in _SCHEMA_LISTS:
        v = node.get(k)
        if isinstance(v, list):
            for i, sub in enumerate(v):
                yield sub, f"{path}/{k}/{i}"
    if isinstance(node.get("items"), list):  # draft-7 tuple form
        for i, sub in enumerate(node["items"]):
            yield sub, f"{path}/items/{i}"


def check_schema(schema: Any, strict: bool = False, limits: GrammarLimits | None = None) -> None:
    """Bounds of a JSON schema (dict): nesting, $ref chains, size, alternatives, enums,
    regex patterns; `type` values known; with `strict`, every keyword known. Iterative
    (no recursion: a deep schema cannot overflow this stack either)."""
    lim = limits or LIMITS
    nodes = alternatives = enums = 0
    refs: dict[str, set[str]] = {}  # schema path -> the local refs found under it (for chains)
    stack: list[tuple[Any, str, int, list[str]]] = [(schema, "", 0, [""])]
    while stack:
        node, path, depth, owners = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise ValueError(f"response_format: invalid JSON schema: the schema at '{path or '/'}' must be an "
                             f"object or a boolean, got {type(node).__name__}")
        nodes += 1
        if nodes > lim.max_nodes:
            raise _over("the number of schemas in the JSON schema", None, lim.max_nodes,
                        "max_nodes")
        if depth > lim.max_depth:
            raise _over("the JSON schema's nesting depth", None, lim.max_depth, "max_depth")
        t = node.get("type")
        for one in (t if isinstance(t, list) else [t] if t is not None else []):
            if one not in JSON_TYPES:
                raise ValueError(f"response_format: invalid JSON schema: the schema at '{path or '/'}' has type "
                                 f"{one!r}; a type is one of {', '.join(JSON_TYPES)}")
        if strict:
            for k in node:
                if k not in KNOWN_KEYWORDS and not k.startswith("x-"):
                    raise ValueError(f"response_format: invalid JSON schema: the schema at '{path or '/'}' has the "
                                     f"unknown keyword {k!r}; a strict schema may use only JSON Schema's "
                                     "keywords (its constraint could not be enforced)")
        for k in ("anyOf", "oneOf"):
            if isinstance(node.get(k), list):
                alternatives += len(node[k])
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
        if alternatives > lim.max_alternatives:
            raise _over("the number of anyOf/oneOf branches", None,
                        lim.max_alternatives, "max_alternatives")
        if enums > lim.max_enum:
            raise _over("the number of enum values", None, lim.max_enum, "max_enum")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], lim)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = _pointer_path(ref)
            for o in owners:
                refs.setdefault(o, set()).add(target)
        for sub, p in _subschemas(node, path):
            stack.append((sub, p, depth + 1, [*owners, p] if _is_def(p) else owners))
    _check_ref_chains(refs, lim)


def _is_def(path: str) -> bool:
    parts = path.split("/")
    return len(parts) >= 2 and parts[-2] in ("$defs", "definitions")


def _pointer_path(ref: str) -> str:
    """'#/$defs/A' -> '/$defs/A' (the walker's path form); '#' -> ''."""
    p = ref[1:]
    return p.replace("~1", "/").replace("~0", "~") if p else ""


def _check_ref_chains(refs: dict[str, set[str]], lim: GrammarLimits) -> None:
    """The longest chain of $ref links (a definition whose subtree refers to another
    definition, and so on), cycles cut (a recursive schema is fine: it is compiled once)."""
    longest: dict[str, int] = {}
    for start in refs:
        if start in longest:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(refs.get(start, ())))]
        on_path = {start}
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                on_path.discard(node)
                longest[node] = max((1 + longest.get(t, 0) for t in refs.get(node, ()) if t not in on_path),
                                    default=0)
                if longest[node] > lim.max_ref_depth:
                    raise _over("the longest chain of $ref links", None,
                                lim.max_ref_depth, "max_ref_depth")
                continue
            if nxt in on_path or nxt in longest or nxt not in refs:
                continue
            on_path.add(nxt)
            stack.append((nxt, iter(refs[nxt])))


_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z][A-Za-z0-9_-]*[ \t]*::=", re.M)


def check_grammar(text: str, syntax: str, limits: GrammarLimits | None = None) -> None:
    """Bounds of a Lark or GBNF grammar: size, rules, alternatives ('|' outside quoted
    strings: regex alternations count too, they cost the lexer alike)."""
    lim = limits or LIMITS
    size = len(text.encode("utf-8", errors="replace"))
    if size > lim.max_bytes:
        raise _over("the grammar's size in bytes", size, lim.max_bytes, "max_bytes")
    rules = len((_GBNF_RULE if syntax == "gbnf" else _LARK_RULE).findall(text))
    if rules > lim.max_rules:
        raise _over("the number of grammar rules", rules, lim.max_rules, "max_rules")
    alternatives = _STRING.sub("", text).count("|")
    if alternatives > lim.max_alternatives:
        raise _over("the number of grammar alternatives ('|')", alternatives, lim.max_alternatives,
                    "max_alternatives")


def check_regex(pattern: str, limits: GrammarLimits | None = None) -> None:
    """Bounds of a regex: its size, and its counted repetitions multiplied through nesting
    (`(x{1000}){1000}` and `x{1000}{1000}` are a million x's to the compiler)."""
    lim = limits or LIMITS
    if len(pattern) > lim.max_regex_bytes:
        raise _over("the regex's length", len(pattern), lim.max_regex_bytes, "max_regex_bytes")
    if _repetition(pattern) > lim.max_repetition:
        raise _over("the regex's counted repetitions multiplied through nesting",
                    None, lim.max_repetition, "max_repetition")


_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def _repetition(p: str) -> int:
    """The largest product of nested counted repetitions in regex `p` (an upper bound on
    how many times the compiler unrolls its innermost atom)."""
    groups = [1]  # the worst multiplier inside each open group
    last = 1  # the multiplier of the atom just read (what a following {n} repeats)
    i, n = 0, len(p)
    worst = 1
    while i < n:
        c = p[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":  # a class is one atom: skip to its end
            j = i + 1
            if j < n and p[j] == "^":
                j += 1
            if j < n and p[j] == "]":
                j += 1
            while j < n and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            groups.append(1)
            i += 1
            continue
        if c == ")":
            inner = groups.pop() if len(groups) > 1 else 1
            last = inner
            groups[-1] = max(groups[-1], inner)
            i += 1
            continue
        if c == "{":
            m = _COUNT.match(p, i)
            if m and (m.group(1) or m.group(2)):
                hi = int(m.group(2) or m.group(1) or 0) if m.group(2) != "" else int(m.group(1) or 0)
                hi = min(max(hi, 1), 10**12)
                last = last * hi
                groups[-1] = max(groups[-1], last)
                worst = max(worst, last)
                if worst > 10**12:
                    return worst
                i = m.end()
                continue
        last = 1
        groups[-1] = max(groups[-1], 1)
        i += 1
    return max(worst, *groups)

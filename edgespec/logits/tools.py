"""Tool (function) calls: the tool list checked, rendered by the model's own chat template,
and the model's own call format parsed back.

A model writes its calls in the format it was trained on; the chat template says which
(FORMATS, chosen by `tool_format(template)`):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen 2/2.5/3, Hermes, SmolLM3
    llama3   {"name": ..., "parameters": {...}} as the whole reply       Llama 3.1/3.2/3.3
             (optionally after <|python_tag|>, several joined by ';')
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]        Mistral 7B v0.3, Nemo, Small
             or [TOOL_CALLS]name[ARGS]{...} (v11+ tokenizers)
    gemma    ```tool_code\\nname(key=value, ...)\\n```                   Gemma 2/3 (Python call syntax)

A template that renders the tool list itself (it reads `tools`, or SmolLM3's `xml_tools`)
gets them as `apply_chat_template(tools=...)` passes them. A template that does not
(SmolLM2, Gemma) gets the list and the call format described in a system message
(`fallback_messages`), and earlier calls and results written in that format.

`tool_choice`: "auto" (the model decides; its reply is parsed), "none" (no tools offered,
nothing parsed), "required" and a named function: the reply is constrained by a JSON
schema built from the tools' parameter schemas (edgespec's response_format): a named
function's reply is its arguments object; "required" replies with a JSON array of
{"name", "arguments"} calls (one at most with parallel_tool_calls=False). An arguments
object takes no properties beyond those declared unless its schema says otherwise.

About 680 lines: the call formats of each model family, their streaming reader and the
tool_choice constraints all read the one table of formats above; split, each half would
import the other.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from jinja2 import Environment, meta

from edgespec.logits.structured.bounds import check_schema

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # as OpenAI's function names
TOOL_CHOICES = ("auto", "none", "required")


# ------------------------------------------------------------------ calls
@dataclass
class ToolCall:
    """One call the model made: `arguments` is the parsed JSON object."""

    name: str
    arguments: dict
    id: str = ""

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self) -> dict:
        """As OpenAI's `message.tool_calls[i]` (arguments as a JSON string)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


def new_call_id(fmt: str = "hermes") -> str:
    """A fresh call id. Mistral's templates accept only 9 alphanumeric characters."""
    if fmt == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ------------------------------------------------------------------ tools checked
def check_tools(tools) -> list[dict]:
    """The tool list in OpenAI's form, checked: [{"type": "function", "function": {"name",
    "description"?, "parameters"?}}]. A bare function dict ({"name", ...}) is accepted too.
    Errors are ValueErrors naming the tool."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, "
                         f"got {type(tools).__name__}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}] must be an object, got {type(t).__name__}")
        if "function" in t or "type" in t:
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
            fn = t.get("function")
        else:
            fn = t
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ValueError(f"tools[{i}]: a second function named {name!r}")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, "
                             f"got {type(params).__name__}")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if params is not None:  # checked whatever the tool_choice: the model is shown this schema
            try:
                check_schema(params, strict=fn.get("strict") is True)
            except ValueError as e:
                raise ValueError(f"tools[{i}].function.parameters: {str(e).removeprefix('response_format: ')}") from None
        if fn.get("strict") is not None:
            clean["strict"] = bool(fn["strict"])
        out.append({"type": "function", "function": clean})
    return out


def check_tool_choice(choice, tools: list[dict]) -> str | dict:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs a non-empty tools list")
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice must name a function as {'type': 'function', 'function': {'name': ...}}")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(names) or 'none given'})")
        return {"type": "function", "function": {"name": name}}
    raise ValueError(f"tool_choice must be a string or an object, got {type(choice).__name__}")


def check_message_tool_calls(i: int, calls) -> list[dict]:
    """An input assistant message's `tool_calls`, checked; arguments parsed to objects."""
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"message {i}: tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"message {i}: tool_calls[{j}] must be {{'type': 'function', 'function': "
                             "{'name': ..., 'arguments': ...}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"message {i}: tool_calls[{j}].function.arguments is not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"message {i}: tool_calls[{j}].function.arguments must be a JSON object")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ValueError(f"message {i}: tool_calls[{j}].id must be a string")
        out.append({"id": cid or "", "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ formats
def _json_values(text: str) -> list | None:
    """All JSON values in `text`, separated by whitespace, ',' or ';' -> list, or None
    when anything else is there."""
    dec = json.JSONDecoder()
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return values
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(v)


def _call_from_obj(obj) -> tuple[str, dict] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return name, args


def _calls_from_json(block: str) -> list[tuple[str, dict]] | None:
    values = _json_values(block)
    if not values:
        return None
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    calls = [_call_from_obj(v) for v in flat]
    return None if not calls or any(c is None for c in calls) else calls


def _calls_mistral(block: str) -> list[tuple[str, dict]] | None:
    calls = _calls_from_json(block)  # [TOOL_CALLS][{...}, ...]
    if calls is not None:
        return calls
    # v11+ tokenizers: [TOOL_CALLS]name[ARGS]{...}, repeated
    out = []
    for part in block.split("[TOOL_CALLS]"):
        if not part.strip():
            continue
        name, sep, args = part.partition("[ARGS]")
        if not sep:
            return None
        values = _json_values(args)
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        out.append((name.strip(), values[0]))
    return out or None


def _calls_python(block: str) -> list[tuple[str, dict]] | None:
    """`name(key=value, ...)` calls, one per line or in a list, with literal arguments."""
    src = block.strip()
    try:
        tree = ast.parse(src, mode="eval")
    except SyntaxError:
        try:
            tree = ast.parse("[" + ",".join(x for x in src.splitlines() if x.strip()) + "]", mode="eval")
        except SyntaxError:
            return None
    nodes = tree.body.elts if isinstance(tree.body, (ast.List, ast.Tuple)) else [tree.body]
    out = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        out.append((node.func.id, args))
    return out or None


def _render_json_call(name: str, args: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    """How one family of models writes calls. `start`: the text that opens a call (None:
    the reply is a call when it starts with '{', as Llama's); `end`: the text that closes
    one (None: the call runs to the end of the reply)."""

    name: str
    start: str | None
    end: str | None
    parse: Callable[[str], list[tuple[str, dict]] | None]
    render_calls: Callable[[list[dict]], str]  # assistant tool_calls -> text (templates without tools)
    render_result: Callable[[str], str]  # a tool message's content -> text (templates without tools)
    instructions: str  # how to call, for templates that do not render tools

    def describe(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return self.instructions.replace("{tools}", listing)


_HERMES_INSTRUCTIONS = (
    "You can call functions to help with the user's request. The functions, as JSON schemas, "
    "are listed between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and its arguments between "
    "<tool_call> and </tool_call>, one block per call:\n<tool_call>\n"
    '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
)
_GEMMA_INSTRUCTIONS = (
    "You can call functions to help with the user's request. They are described as JSON schemas:\n"
    "{tools}\nTo call one, reply with the call in Python syntax in a tool_code block:\n"
    "```tool_code\nfunction_name(argument=value)\n```\nResults come back in a tool_output block."
)
_LLAMA_INSTRUCTIONS = (
    "You can call functions to help with the user's request. They are described as JSON schemas:\n"
    "{tools}\nTo call one, reply with only a JSON object: "
    '{"name": "<function name>", "parameters": {<arguments as JSON>}}'
)

FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        "hermes", "<tool_call>", "</tool_call>", _calls_from_json,
        lambda calls: "\n".join(f"<tool_call>\n{_render_json_call(c['function']['name'], c['function']['arguments'])}"
                                "\n</tool_call>" for c in calls),
        lambda content: f"<tool_response>\n{content}\n</tool_response>",
        _HERMES_INSTRUCTIONS),
    "llama3": ToolFormat(
        "llama3", None, None, _calls_from_json,
        lambda calls: "; ".join(_render_json_call(c["function"]["name"], c["function"]["arguments"], "parameters")
                                for c in calls),
        lambda content: content,
        _LLAMA_INSTRUCTIONS),
    "mistral": ToolFormat(
        "mistral", "[TOOL_CALLS]", None, _calls_mistral,
        lambda calls: "[TOOL_CALLS]" + json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                                   for c in calls], ensure_ascii=False),
        lambda content: f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]",
        _HERMES_INSTRUCTIONS.replace("<tool_call>", "[TOOL_CALLS]")),
    "gemma": ToolFormat(
        "gemma", "```tool_code", "```", _calls_python,
        lambda calls: "\n".join("```tool_code\n" + c["function"]["name"] + "(" + ", ".join(
            f"{k}={v!r}" for k, v in c["function"]["arguments"].items()) + ")\n```" for c in calls),
        lambda content: f"```tool_output\n{content}\n```",
        _GEMMA_INSTRUCTIONS),
}

# Which format a chat template's model writes, by what the template contains (first match).
_DETECT = (
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3"),
    ("ipython", "llama3"),
    ("tool_code", "gemma"),
    ("<start_of_turn>", "gemma"),
)


def tool_format(template: str | None) -> ToolFormat:
    """The call format of the model whose chat template is `template` (hermes by default:
    the format the fallback instructions teach)."""
    for marker, name in _DETECT:
        if template and marker in template:
            return FORMATS[name]
    return FORMATS["hermes"]


def template_tool_variable(template: str | None) -> str | None:
    """The variable through which `template` renders a tool list ("tools", SmolLM3's
    "xml_tools"), or None when it renders none."""
    if not template:
        return None
    try:
        names = meta.find_undeclared_variables(Environment().parse(template))
    except Exception:  # a template jinja cannot parse fails later, where it is rendered
        return None
    for var in ("tools", "xml_tools"):
        if var in names:
            return var
    return None


def prepare_messages(messages: list[dict], fmt: ToolFormat, native: bool) -> list[dict]:
    """Assistant `tool_calls` and `tool` messages made ready for a template: kept as
    structured fields (arguments as objects, as HF templates expect) when it renders tools
    (`native`), else written out as text in the model's call format."""
    names_by_id: dict[str, str] = {}
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                if c.get("id"):
                    names_by_id[c["id"]] = c["function"]["name"]
            if native:
                out.append({**m, "content": m.get("content") or ""})
            else:
                text = "\n".join(x for x in (m.get("content") or "", fmt.render_calls(calls)) if x)
                out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        elif m["role"] == "tool":
            if native:
                name = m.get("name") or names_by_id.get(m.get("tool_call_id") or "")
                out.append({**m, **({"name": name} if name else {})})
            else:
                out.append({"role": "user", "content": fmt.render_result(m["content"])})
        else:
            out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: list[dict], fmt: ToolFormat) -> list[dict]:
    """For a template that renders no tools: the tools and how to call them, in the system
    message (added first, or before the existing system text)."""
    intro = fmt.describe(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + intro}, *messages[1:]]
    return [{"role": "system", "content": intro}, *messages]


# ------------------------------------------------------------------ the plan for one request
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "anyOf", "oneOf", "allOf", "$ref",
         "not", "if")


def _closed(schema):
    """`schema` with every object schema that declares its properties and says nothing
    about others closed (additionalProperties: false), nested ones too: under properties,
    items, prefixItems, $defs and anyOf/oneOf branches. An object composed with allOf,
    $ref, not or if is left as written (closing a part would refuse what the whole allows)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(sub) for name, sub in out[k].items()}
    for k in ("items", "additionalProperties", "contains"):
        if isinstance(out.get(k), dict):
            out[k] = _closed(out[k])
    for k in ("prefixItems", "anyOf", "oneOf", "items"):
        if isinstance(out.get(k), list):
            out[k] = [_closed(sub) for sub in out[k]]
    is_object = out.get("type") == "object" or (out.get("type") is None and "properties" in out)
    if is_object and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def _arguments_schema(tool: dict) -> dict:
    """The schema a constrained call's arguments follow: the function's parameters, with
    no properties beyond those declared unless the schema says otherwise (a function
    takes the parameters it declares; without this a small model keeps adding keys), at
    every level (a nested object takes what it declares too)."""
    return _closed(tool["function"]["parameters"])


def _rebased(schema, prefix: str):
    """`schema` with every local $ref ('#...') rewritten to point below `prefix` ('#/$defs/t'):
    a tool's parameters moved from the root of their own document into the calls' schema,
    so `#/$defs/Sub` (Pydantic's shape) still finds the tool's own $defs."""
    if isinstance(schema, dict):
        return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, prefix))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    return schema


def _named_schema(tool: dict) -> dict:
    return _arguments_schema(tool)


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    defs: dict[str, dict] = {}
    options = []
    for i, t in enumerate(tools):
        args = _arguments_schema(t)
        if _has_local_ref(args):  # kept whole under $defs, its pointers rebased onto it
            key = f"tool{i}_{t['function']['name']}"
            defs[key] = _rebased(args, f"#/$defs/{key}")
            args = {"$ref": f"#/$defs/{key}"}
        options.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": args},
                        "required": ["name", "arguments"], "additionalProperties": False})
    item = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_local_ref(schema) -> bool:
    if isinstance(schema, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _has_local_ref(v)
                   for k, v in schema.items())
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    return False


@dataclass
class ToolPlan:
    """What one request does with tools: the list the template renders (None: none), the
    constraint on the reply (a response_format, or None) and how the reply is read back."""

    tools: list[dict]
    choice: str | dict
    parallel: bool
    fmt: ToolFormat
    render_tools: list[dict] | None = None
    response_format: dict | None = None
    names: set = field(default_factory=set)

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def constrained(self) -> bool:
        return self.response_format is not None

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply."""
        s = self.stream()
        events = s.feed(text) + s.finish()
        content = "".join(e for kind, e in events if kind == "content")
        return content, [e for kind, e in events if kind == "call"]


def plan_tools(tools, tool_choice=None, parallel_tool_calls: bool | None = None,
               template: str | None = None) -> ToolPlan:
    """Check a request's tools and tool_choice (ValueError naming the field) and decide
    what is rendered and constrained."""
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice, tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    plan = ToolPlan(tools, choice, parallel, tool_format(template),
                    names={t["function"]["name"] for t in tools})
    if not tools or choice == "none":
        return plan  # nothing offered: the model answers in words
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        plan.render_tools = [tool]
        plan.response_format = {"type": "json_schema",
                                "json_schema": {"name": tool["function"]["name"], "schema": _named_schema(tool),
                                                "strict": True}}
    else:
        plan.render_tools = tools
        if choice == "required":
            plan.response_format = {"type": "json_schema",
                                    "json_schema": {"name": "tool_calls", "schema": _required_schema(tools, parallel),
                                                    "strict": True}}
    return plan


# ------------------------------------------------------------------ reading replies
class ToolCallStream:
    """Reads a reply as it streams: text goes out as content until a call opens; calls come
    out parsed as each closes (or at the end). `feed(text)` and `finish()` return events
    ("content", str) and ("call", ToolCall). A block that does not parse as calls is content."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.fmt = plan, plan.fmt
        self.buf = ""  # text not yet given out
        self.in_call = False
        self.decided = False  # llama3: whether the reply opened with a call is known
        self.calls: list[ToolCall] = []
        self.content_seen = False
        self.finished = False

    def _call_events(self, parsed: list[tuple[str, dict]]) -> list:
        events = []
        for name, args in parsed:
            if not self.plan.parallel and self.calls:
                break
            call = ToolCall(name, args, new_call_id(self.fmt.name))
            self.calls.append(call)
            events.append(("call", call))
        return events

    def _content(self, text: str) -> list:
        if not text:
            return []
        self.content_seen = True
        return [("content", text)]

    def feed(self, text: str) -> list:
        if not self.plan.parses:
            return self._content(text)
        self.buf += text
        if self.plan.constrained:
            return []  # the whole reply is the call(s): read at the end
        if self.fmt.start is None:
            return self._feed_bare()
        events = []
        while True:
            if not self.in_call:
                k = self.buf.find(self.fmt.start)
                if k < 0:
                    keep = _partial_suffix(self.buf, self.fmt.start)
                    out = self.buf[: len(self.buf) - keep]
                    if self.calls and not self.content_seen and not out.strip():
                        return events  # white space between calls: held (dropped at the end)
                    events += self._content(out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                before = self.buf[:k]
                if before.strip() or self.content_seen:
                    events += self._content(before)
                self.buf, self.in_call = self.buf[k + len(self.fmt.start):], True
            if self.fmt.end is None:
                return events
            k = self.buf.find(self.fmt.end)
            if k < 0:
                return events
            block, self.buf, self.in_call = self.buf[:k], self.buf[k + len(self.fmt.end):], False
            parsed = self._known(self.fmt.parse(block))
            if parsed is None:
                events += self._content(self.fmt.start + block + self.fmt.end)
            else:
                events += self._call_events(parsed)
                self.buf = self.buf.lstrip()

    def _feed_bare(self) -> list:
        if self.decided:
            if self.in_call:
                return []
            out, self.buf = self.buf, ""
            return self._content(out)
        head = self.buf.lstrip()
        if not head:
            return []
        if head.startswith("<|python_tag|>") or head.startswith("{") or head.startswith("["):
            self.decided = self.in_call = True
            return []
        if "<|python_tag|>".startswith(head):
            return []
        self.decided = True
        out, self.buf = self.buf, ""
        return self._content(out)

    def _known(self, parsed):
        if parsed is None or not self.plan.names:
            return parsed
        return parsed if all(name in self.plan.names for name, _ in parsed) else None

    def finish(self) -> list:
        """The end of the reply: what is buffered, as calls or content."""
        if not self.plan.parses or self.finished:
            return []
        self.finished = True
        buf, self.buf = self.buf, ""
        if self.plan.constrained:
            return self._finish_constrained(buf)
        if not self.in_call:
            return [] if self.calls and not self.content_seen and not buf.strip() else self._content(buf)
        block = buf.replace("<|python_tag|>", "", 1) if self.fmt.start is None else buf
        parsed = self._known(self.fmt.parse(block))
        if parsed is None:
            return self._content((self.fmt.start or "") + buf)
        return self._call_events(parsed)

    def _finish_constrained(self, text: str) -> list:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return self._content(text)  # cut short (max_tokens): what came, as text
        if isinstance(self.plan.choice, dict):
            if not isinstance(value, dict):
                return self._content(text)
            return self._call_events([(self.plan.choice["function"]["name"], value)])
        parsed = [_call_from_obj(v) for v in value] if isinstance(value, list) else []
        if not parsed or any(p is None for p in parsed) or self._known(parsed) is None:
            return self._content(text)
        return self._call_events(parsed)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def openai_tool_call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[dict]:
    """Streamed `delta.tool_calls` entries, as OpenAI sends them: the id, type and name
    first with empty arguments, then the arguments."""
    out = []
    for k, c in enumerate(calls):
        i = first_index + k
        out.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
        out.append({"index": i, "function": {"arguments": c.arguments_json}})
    return out

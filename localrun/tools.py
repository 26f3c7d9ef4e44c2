"""Tool calling: the model's own chat template renders the tools; its output is parsed back
into OpenAI `tool_calls` by the format of the template's family.

Families (picked from the template's text):
- hermes:  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes 2 Pro,
  Qwen 2.5/3, SmolLM3 and most templates that take `tools`);
- llama3:  a bare `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` (also `[TOOL_CALLS]name[ARGS]{...}`).

`tool_choice` "required" or a named function is enforced with a grammar (localrun.grammar):
the output is then one call (or several, with parallel_tool_calls) in the family's format,
its arguments following the function's JSON schema. "auto" lets the model choose, and the
output is parsed after the fact.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localrun.errors import UserError

FAMILIES = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


class ToolError(UserError, ValueError):
    """A bad tools request; `field` names the request field (a 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def supports_tools(template: str | None) -> bool:
    """Whether the chat template reads `tools` at all (else tools would be silently dropped)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def family(template: str | None) -> str:
    t = template or ""
    if MISTRAL_TAG in t:
        return "mistral"
    if HERMES_OPEN in t:
        return "hermes"
    if PYTHON_TAG in t or "ipython" in t:
        return "llama3"
    return "hermes"          # the most common format among templates that take tools


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_tools(tools: list[dict], tool_choice, template: str | None) -> str | None:
    """The function name that tool_choice forces (or None), after the checks that give a 400:
    the request's own consistency first, then whether this model can take tools."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools", "tool function names must be unique")
    for t in tools:
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError("tools", f"tool '{t['function']['name']}': parameters must be a JSON schema object")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice names '{name}', which is not among the tools "
                                           f"({', '.join(names)})")
    if not supports_tools(template):
        raise ToolError("tools", "this model's chat template does not take tools, so the model would never "
                                 "see them; send the request without tools")
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def call_schema(tool: dict, family_name: str) -> dict:
    """The JSON schema of one call to `tool` in the family's object shape."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    key = "parameters" if family_name == "llama3" else "arguments"
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(tools: list[dict], family_name: str, parallel: bool) -> tuple[str, list[dict]]:
    """(Lark grammar, schemas checked) whose strings are the family's tool calls to `tools`
    (one, or one or more when parallel)."""
    schemas = [call_schema(t, family_name) for t in tools]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    compact = {"x-guidance": {"whitespace_flexible": False}}    # no runs of whitespace between tokens
    body = json.dumps({**one, **compact})
    if family_name == "hermes":
        call = '"' + HERMES_OPEN + '\\n" %json ' + body + ' "\\n' + HERMES_CLOSE + '"'
        more = ' ("\\n" call)*' if parallel else ""
        rule = "start: call" + more + "\ncall: " + call + "\n"
    elif family_name == "mistral":
        items = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1}), **compact}
        rule = f'start: "{_lark_escape(MISTRAL_TAG)}" %json {json.dumps(items)}\n'
    else:                   # llama3: one JSON object (Llama 3.1 calls one function per turn)
        rule = f"start: %json {body}\n"
    return rule, schemas


def _lark_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# --- parsing the model's output ------------------------------------------------------------------
def parse_calls(text: str, family_name: str, tool_names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content left, tool calls) from a complete reply. A call naming no known tool, or
    whose JSON does not parse, stays in the content (it is not a call we can answer)."""
    if family_name == "mistral":
        return _parse_mistral(text, tool_names)
    if family_name == "llama3":
        return _parse_llama3(text, tool_names)
    return _parse_hermes(text, tool_names)


def _call_from(obj, tool_names: set[str], args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):         # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _parse_hermes(text: str, tool_names: set[str]):
    calls, content = [], []
    pos = 0
    for m in re.finditer(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", text, re.S):
        try:
            call = _call_from(json.loads(m.group(1).strip()), tool_names)
        except ValueError:
            call = None
        if call is None:
            continue
        content.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    content.append(text[pos:])
    rest = "".join(content).strip()
    return (rest or None) if calls else text, calls


def _parse_llama3(text: str, tool_names: set[str]):
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return text, []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call_from(o, tool_names) for o in objs]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


def _parse_mistral(text: str, tool_names: set[str]):
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return text, []
    head, body = text[:at].strip(), text[at + len(MISTRAL_TAG):].strip()
    calls = []
    try:
        objs = json.loads(body)
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call_from(o, tool_names) for o in objs]
    except ValueError:        # the newer `name[ARGS]{...}` form, one per tag
        for part in body.split(MISTRAL_TAG):
            name, sep, args = part.partition("[ARGS]")
            try:
                calls.append(_call_from({"name": name.strip(), "arguments": json.loads(args)}, tool_names)
                             if sep else None)
            except ValueError:
                calls.append(None)
    if not calls or any(c is None for c in calls):
        return text, []
    return head or None, calls


class ToolStream:
    """Splits a streamed reply into content that is safe to show now and the tool-call text,
    which is held back and parsed at the end: a client never sees half a call as content."""

    def __init__(self, family_name: str, forced: bool):
        self.family = family_name
        self.capturing = forced              # required / named: the whole reply is calls
        self.pending = ""                    # text that may still turn into a call's start
        self.shown = 0                       # characters of the reply emitted as content

    def feed(self, text: str) -> str:
        """Content to emit now."""
        out = self._feed(text)
        self.shown += len(out)
        return out

    def _feed(self, text: str) -> str:
        if self.capturing:
            return ""
        if self.family == "none":            # decided: plain content
            return text
        self.pending += text
        marker = {"hermes": HERMES_OPEN, "mistral": MISTRAL_TAG}.get(self.family)
        if marker is None:                   # llama3: a reply that opens with '{' or the tag is a call
            head = self.pending.lstrip()
            if not head:
                return ""
            if head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
                self.capturing = True
                return ""
            out, self.pending = self.pending, ""
            self.family = "none"             # plain content from here on
            return out
        at = self.pending.find(marker)
        if at >= 0:
            out, self.capturing = self.pending[:at], True
            return out
        keep = _partial_suffix(self.pending, marker)     # the marker may be arriving
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolPlan:
    """How one chat request with tools runs: what the template gets, which format the reply
    is parsed in, and the grammar that forces a call (required / named), if any."""
    tools: list[dict] | None       # for the template; None when tool_choice is "none"
    family: str
    names: set[str]
    constraint: object = None      # grammar.Constraint when a call is forced
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.constraint is not None

    @classmethod
    def build(cls, tools, tool_choice, parallel: bool, template: str | None, compiler) -> ToolPlan:
        tools = check_shapes(tools)
        tool_choice = "auto" if tool_choice is None else tool_choice
        if tool_choice not in ("auto", "none", "required") and not (
                isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict)):
            raise ToolError("tool_choice", "tool_choice must be 'auto', 'none', 'required' or "
                                           "{'type': 'function', 'function': {'name': ...}}")
        if tool_choice == "none":
            return cls(None, family(template), set())
        named = check_tools(tools, tool_choice, template)
        from localrun.grammar import GrammarError, check_schema
        for t in tools:
            try:
                check_schema(t["function"].get("parameters") or {}, "tools",
                             f"tools.{t['function']['name']}.parameters")
            except GrammarError as e:
                raise ToolError("tools", str(e)) from None
        fam = family(template)
        plan = cls(tools, fam, {t["function"]["name"] for t in tools}, parallel=parallel)
        if tool_choice == "required" or named is not None:
            forced = [t for t in tools if named is None or t["function"]["name"] == named]
            lark, _ = call_grammar(forced, fam, parallel and named is None)
            try:
                plan.constraint = compiler.lark(lark, "tools")
            except GrammarError as e:
                raise ToolError("tools", str(e)) from None
        return plan

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse_calls(text, self.family, self.names)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def stream(self) -> ToolStream:
        return ToolStream(self.family, self.forced)


def check_shapes(tools) -> list[dict]:
    """OpenAI tool definitions: [{"type": "function", "function": {"name", "parameters"?, ...}}]."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", "tools must be a non-empty list of {type: function, function: {...}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError("tools", f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
    return tools

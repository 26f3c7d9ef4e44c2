"""A jinja2 sandbox with limits, for chat templates that come from model files.

jinja2's ImmutableSandboxedEnvironment stops attribute tricks but not resource use: `7 ** 999999999`,
`'x' * 10**9`, nested loops, recursive macros and 100 MB of output all run. Here:
- every operator, call and filter that can build a large value is checked *before* it runs
  (sizes over `max_chars`, integers over `MAX_INT_BITS` bits), and every result after;
- the total size of values built in one render is bounded (`BUDGET_FACTOR * max_chars`);
- a wall-clock limit and a recursion cap are enforced by a trace function on template code
  only (this thread, this render), so loops and macros stop within the limit;
- the output is bounded as it is produced; include/import/extends have no loader and are refused;
- compiling is bounded before it starts (`MAX_TEMPLATE_CHARS`, `MAX_TEMPLATE_TOKENS`), runs no
  template code (jinja2's constant folding is off), and whatever jinja2 or Python's compiler
  raises on hostile source (nesting past Python's limits: SyntaxError, RecursionError) is a refusal.
Every breach raises TemplateLimitError with one sentence.
"""
from __future__ import annotations

import inspect
import itertools
import re
import sys
import threading
import time
from dataclasses import dataclass
from functools import wraps

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_INT_BITS = 4096
# Compiling is bounded before it starts. A template's compile time and memory grow with its
# lexer tokens, not its characters (text is one token however long; `a+a+a...` costs the most per
# character), so the tokens are the bound that matters; both leave real templates (llama.cpp's
# reference set) room many times over. Sizes and costs: docs/measurements.md, MAX_TEMPLATE_TOKENS.
MAX_TEMPLATE_CHARS = 256 << 10
MAX_TEMPLATE_TOKENS = 32 << 10
BUDGET_FACTOR = 16        # values built in one render, in multiples of the output limit
_WIDTH = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?|\{[^{}]*\}")   # %-specs, {}-fields
_DIGITS = re.compile(r"\d+")


class TemplateLimitError(Exception):
    """A chat template went past a sandbox limit (time, size, recursion, a forbidden tag)."""


@dataclass(frozen=True)
class Limits:
    seconds: float = 2.0            # wall clock of one render
    max_chars: int = 4 << 20        # output, and any one value built while rendering
    max_depth: int = 32             # nested macro calls / recursive loops


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


class _Render(threading.local):
    """The limits of the render running on this thread (None outside a render)."""
    limits: Limits | None = None
    deadline: float = 0.0
    budget: int = 0
    depth: int = 0


_active = _Render()


def _charge(value, max_chars: int):
    """Check one built value against the limits; count it against this render's budget."""
    n = _size(value)
    if n > max_chars:
        raise TemplateLimitError(f"the chat template builds a value of {n:,} items, over the limit of {max_chars:,}")
    if _active.limits is not None:
        _active.budget -= n
        if _active.budget < 0:
            raise TemplateLimitError(f"the chat template builds more than {BUDGET_FACTOR * max_chars:,} characters "
                                     "in one render")
    return value


class _CodeGenerator(CodeGenerator):
    """`a ~ b` goes through environment.concat, which checks the size first; `{{ expression }}`
    is never evaluated while compiling (jinja2 folds constant outputs into the code: filters
    run outside any render's limits, and a 1 MB result per output lands in the source)."""

    def _output_child_to_const(self, node, frame, finalize):
        if not isinstance(node, nodes.TemplateData):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}` (it marks the assistant's part for
    training masks): rendered as its body, so templates that use it still compile."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """One environment serves every limit: its checks read the running render's Limits, so a
    template compiles once whatever limits it is rendered with."""
    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = _CodeGenerator

    def __init__(self, max_chars: int = Limits.max_chars):
        # optimized=False: jinja2's optimizer folds constant expressions while compiling, which
        # runs filters outside any render's limits and costs time cubic in an expression's
        # nesting (a chain of 150 `+` or filters); rendering the same expression is linear
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag],
                         optimized=False)
        self.default_max_chars = max_chars      # outside render_bounded
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)
        self.globals["range"] = self.range

    @property
    def max_chars(self) -> int:
        limits = _active.limits
        return limits.max_chars if limits is not None else self.default_max_chars

    # -- what templates can call ---------------------------------------------------------
    def range(self, *args):
        for a in args:
            self._check_int("range", a)
        r = range(*args)
        if len(r) > self.max_chars:
            raise TemplateLimitError(f"the chat template asks for a range of {len(r):,} numbers")
        return r

    def _check_int(self, what: str, value) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
            raise TemplateLimitError(f"the chat template passes {what} the number {value}, over the limit of "
                                     f"{self.max_chars:,}")

    def _check_widths(self, what: str, fmt: str) -> None:
        for spec in _WIDTH.finditer(fmt):
            for digits in _DIGITS.findall(spec.group(0)):
                if len(digits) > 9 or int(digits) > self.max_chars:
                    raise TemplateLimitError(f"the chat template formats with {what} width {digits}, over the "
                                             f"limit of {self.max_chars:,}")

    def call_binop(self, context, operator: str, left, right):
        limit = self.max_chars
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * left.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template raises {left} to the power {right}, a number over "
                                         f"{MAX_INT_BITS} bits")
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateLimitError(f"the chat template multiplies numbers into more than {MAX_INT_BITS} bits")
            elif isinstance(right, int) and right * _size(left) > limit or \
                    isinstance(left, int) and left * _size(right) > limit:
                raise TemplateLimitError(f"the chat template repeats a value past the limit of {limit:,} items")
        if operator == "+" and _size(left) + _size(right) > limit:
            raise TemplateLimitError(f"the chat template joins values past the limit of {limit:,} items")
        if operator == "%" and isinstance(left, str):
            self._check_widths("%", left)
            for value in right if isinstance(right, tuple) else (right,):
                self._check_int("%", value)
        return _charge(super().call_binop(context, operator, left, right), limit)

    def concat(self, parts) -> str:
        strings = [str(p) for p in parts]
        if sum(map(len, strings)) > self.max_chars:
            raise TemplateLimitError(f"the chat template joins strings past the limit of {self.max_chars:,} characters")
        return _charge("".join(strings), self.max_chars)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's signature)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        for value in (*args, *kwargs.values()):
            __self._check_int(name, value)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, name, args)
        return _charge(super().call(__context, __obj, *args, **kwargs), __self.max_chars)

    def _check_str_method(self, s: str, name: str, args) -> None:
        if name in ("expandtabs", "translate"):
            raise TemplateLimitError(f"the chat template calls str.{name}, which chat templates may not")
        if name in ("format", "format_map"):
            self._check_widths("format", s)
        if name == "replace" and len(args) >= 2:
            self._check_replace(s, *args[:2])
        if name == "join" and args:
            self._check_join(s, args[0])

    def _check_replace(self, s, old, new) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            grown = len(s) + (s.count(old) if old else len(s) + 1) * max(0, len(new) - len(old))
            if grown > self.max_chars:
                raise TemplateLimitError(f"the chat template's replace() would build {grown:,} characters, over the "
                                         f"limit of {self.max_chars:,}")

    def _check_join(self, sep, items) -> None:
        if isinstance(items, (list, tuple)):
            total = sum(_size(x) if isinstance(x, str) else 16 for x in items) + _size(sep) * len(items)
            if total > self.max_chars:
                raise TemplateLimitError(f"the chat template's join would build {total:,} characters, over the "
                                         f"limit of {self.max_chars:,}")

    def _bounded_filter(self, name: str, f):
        signature = inspect.signature(f)

        @wraps(f)
        def bounded(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                self._check_int(f"the {name} filter", value)
            self._check_filter(name, signature, args, kwargs)
            return _charge(f(*args, **kwargs), self.max_chars)
        return bounded

    def _check_filter(self, name: str, signature, args, kwargs) -> None:
        if name not in ("replace", "join", "indent", "format", "sum", "tojson", "center"):
            return
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return      # the filter itself reports the wrong call
        a = bound.arguments
        if name == "replace":
            self._check_replace(a.get("s"), a.get("old"), a.get("new"))
        elif name == "join" and isinstance(a.get("value"), (list, tuple)):
            self._check_join(a.get("d", ""), a["value"])
        elif name == "indent":
            width, s = a.get("width", 4), a.get("s", "")
            width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            if isinstance(s, str) and len(s) + (s.count("\n") + 1) * width > self.max_chars:
                raise TemplateLimitError("the chat template indents past the size limit")
        elif name == "format" and isinstance(a.get("value"), str):
            self._check_widths("format", a["value"])
        elif name == "sum":
            items = a.get("iterable")
            if isinstance(items, (list, tuple)) and sum(_size(x) for x in items) > self.max_chars:
                raise TemplateLimitError("the chat template sums sequences past the size limit")
        elif name == "tojson":
            indent = a.get("indent")
            if _size(indent) > 16 or isinstance(indent, int) and indent > 16:
                raise TemplateLimitError("the chat template's tojson indent is over 16")


def compile_template(env: BoundedEnvironment, source: str) -> jinja2.Template:
    """Compile within bounds on the work it takes. A syntax error raises jinja2's
    TemplateSyntaxError; a template over a bound, a forbidden tag, or one that jinja2 turns into
    Python that Python cannot compile (blocks or expressions nested past its limits) raises
    TemplateLimitError. Nothing else escapes: the source comes from a file."""
    check_size(source)
    try:
        # lexing is a regular-expression scan; parsing, code generation and Python's compile
        # cost grow with the tokens, so count them first (stopping at the bound)
        num_tokens = sum(1 for _ in itertools.islice(env.lex(source), MAX_TEMPLATE_TOKENS + 1))
        if num_tokens > MAX_TEMPLATE_TOKENS:
            raise TemplateLimitError(f"the chat template has more than {MAX_TEMPLATE_TOKENS:,} tokens of template "
                                     "syntax, over the limit")
        ast = env.parse(source)
        for tag, node_type in (("include", nodes.Include), ("import", nodes.Import), ("import", nodes.FromImport),
                               ("extends", nodes.Extends)):
            if next(ast.find_all(node_type), None) is not None:
                raise TemplateLimitError(f"the chat template uses {{% {tag} %}}, which chat templates may not")
        return env.from_string(ast)
    except (TemplateLimitError, jinja2.exceptions.TemplateSyntaxError):
        raise
    except RecursionError:
        raise TemplateLimitError("the chat template is nested too deeply to compile") from None
    except MemoryError:
        raise TemplateLimitError("the chat template runs out of memory while compiling") from None
    except SyntaxError as e:     # IndentationError too: Python's limits on nested blocks and brackets
        raise TemplateLimitError(f"the chat template cannot be compiled, as Python refuses the code jinja2 makes of it "
                                 f"({one_line(e.msg)})") from None
    except Exception as e:       # e.g. ValueError: an integer literal past Python's digit limit
        raise TemplateLimitError(f"the chat template cannot be compiled ({type(e).__name__}: "
                                 f"{one_line(str(e))})") from None


def check_size(source: str) -> None:
    """The length bound alone (no lexing): TemplateLimitError for a template over it."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"the chat template is {len(source):,} characters long, over the limit of "
                                 f"{MAX_TEMPLATE_CHARS:,}")


def one_line(text: str, limit: int = 160) -> str:
    """One line of at most `limit` characters (messages can quote the template)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render_bounded(template: jinja2.Template, limits: Limits, **context) -> str:
    """template.render(**context) within `limits`; TemplateLimitError when it goes past one."""
    assert _active.limits is None, "renders do not nest"
    _active.limits, _active.deadline = limits, time.monotonic() + limits.seconds
    _active.budget, _active.depth = BUDGET_FACTOR * limits.max_chars, 0
    previous = sys.gettrace()
    sys.settrace(_trace_calls)
    try:
        out, n = [], 0
        for chunk in template.generate(**context):
            n += len(chunk)
            if n > limits.max_chars:
                raise TemplateLimitError(f"the chat template's output exceeds {limits.max_chars:,} characters")
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise TemplateLimitError("the chat template recurses too deeply") from None
    except MemoryError:
        raise TemplateLimitError("the chat template ran out of memory") from None
    finally:
        sys.settrace(previous)
        _active.limits = None


def _check_deadline() -> None:
    if time.monotonic() > _active.deadline:
        raise TemplateLimitError(f"the chat template ran past its time limit of {_active.limits.seconds:g} s")


def _trace_calls(frame, event, arg):
    """sys.settrace hook: line-level checks in template code only (its file is '<template>')."""
    if _active.limits is None:
        return None
    _check_deadline()
    if frame.f_code.co_filename != "<template>":
        return None
    _active.depth += 1
    if _active.depth > _active.limits.max_depth:
        raise TemplateLimitError(f"the chat template nests macro calls or recursive loops more than "
                                 f"{_active.limits.max_depth} deep")
    return _trace_template_lines


def _trace_template_lines(frame, event, arg):
    if _active.limits is None:
        return None
    if event == "return":
        _active.depth -= 1
        if _size(arg) > _active.limits.max_chars:
            raise TemplateLimitError(f"the chat template builds a value over {_active.limits.max_chars:,} characters")
    else:
        _check_deadline()
    return _trace_template_lines

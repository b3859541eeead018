"""The gateway's TOML configuration, read and checked before anything starts.

Every refusal is a `ConfigError` naming the table and key, what was expected and what was
found (`[tools.create_invoice] key.from: expected one of ...`). The checks that need the
upstream (does the tool exist, does its input schema have the argument a key names) are
`check_against_tools`, run once the upstream answered `tools/list`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledger.errors import InvalidInput
from ledger.inputs import check_identifier, check_operation_name
from ledger.states import RetryPolicy

PASS_THROUGH = "pass-through"
CONSEQUENTIAL = "consequential"

KEY_FROM_SESSION = "session"   # the default key (also spelled "default")
KEY_FROM_DEFAULT = "default"
KEY_FROM_ARGUMENTS = "arguments"
KEY_FROM_META = "meta"

# What the default key does with a same-arguments call it cannot take for a retry (outside
# the retry window, or another call of the tool or on its resource came between): send it
# as a new intent, or answer that the call needs an explicit key.
REPEAT_SEND = "send"
REPEAT_ASK = "ask"

# The `_meta` entry an MCP client sets to name its own idempotency key for one tool call.
META_KEY = "agent-ledger/idempotency-key"

# `[upstream] protocol`: how the gateway's client negotiates with the upstream.
UPSTREAM_PROTOCOLS = ("auto", "2026-07-28", "legacy")

ON_ERROR_REJECTED = "rejected"
ON_ERROR_UNKNOWN = "unknown"

DEFAULT_TIMEOUT = 30.0
# How long after a call ends a call of the same tool with the same arguments (and no other
# call of that tool between) is taken as its retry under the default key.
DEFAULT_RETRY_WINDOW = 30.0
DEFAULT_MAX_RESULT_BYTES = 256 * 1024
# A forwarded upstream result larger than this (JSON bytes) is refused, not forwarded whole.
DEFAULT_MAX_FORWARD_BYTES = 4 * 1024 * 1024
_TEMPLATE = re.compile(r"\{([A-Za-z0-9_.-]+)\}")
_PATH = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


class ConfigError(ValueError):
    """The configuration cannot be used: what was expected, what was found, where."""


@dataclass(frozen=True)
class Upstream:
    command: tuple[str, ...] = ()
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    connect_timeout: float = 30.0
    # The MCP protocol spoken to the upstream: "auto" (try 2026-07-28's server/discover,
    # fall back to the initialize handshake of 2025-11-25 and older, as the SDK does),
    # "2026-07-28" (no probe), or "legacy" (the handshake only).
    protocol: str = "auto"

    def describe(self) -> str:
        return self.url or " ".join(self.command)


@dataclass(frozen=True)
class Rule:
    """A condition on a read tool's result; every part given must hold."""

    path: str = ""          # dotted, into structuredContent
    equals: Any = None      # a value, or a template over the original call's stored arguments
    one_of: tuple = ()
    exists: bool | None = None
    matches: str = ""       # a regular expression on the value at `path` (as text)
    text_matches: str = ""  # a regular expression on the result's joined text content
    is_error: bool | None = None


@dataclass(frozen=True)
class Reconcile:
    tool: str
    arguments: dict[str, Any]
    found: Rule
    absent: Rule | None
    not_yet: Rule | None
    external_id: str = ""            # a path into the read's structuredContent
    external_id_template: str = ""   # or a template over the original call's arguments
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Tool:
    name: str
    mode: str = PASS_THROUGH
    operation: str = ""
    target: str = ""
    key_from: str = KEY_FROM_SESSION
    key_names: tuple[str, ...] = ()
    keep: tuple[str, ...] | None = None
    redact: tuple[str, ...] = ()
    external_id: str = ""
    external_id_template: str = ""
    timeout: float = DEFAULT_TIMEOUT
    retry_policy: str = RetryPolicy.IF_ABSENT_PROVEN
    # The provider account its calls act as (a label, never a credential): on each
    # receipt, for the reconciler to read as; None: [gateway] account.
    account: str | None = None
    approval_wait: float = 0.0
    in_flight: float | None = None
    reconcile: Reconcile | None = None
    # How a tool error (a result with isError) is recorded: patterns on its text (and on
    # the value at `error_code` of its structured result), first rejected_when, then
    # unknown_when, else `on_error` (default rejected: the upstream said it did nothing).
    on_error: str = "rejected"
    rejected_when: tuple[str, ...] = ()
    unknown_when: tuple[str, ...] = ()
    error_code: str = ""
    retry_window: float = DEFAULT_RETRY_WINDOW
    # The default key's answer to a same-arguments call it cannot take for a retry; None:
    # decided by the upstream's idempotentHint (false: ask; otherwise: send).
    repeat: str | None = None
    # Argument names that name the resource a call changes (e.g. ["path"]): a call of any
    # consequential tool on the same resource between two same-arguments calls makes the
    # second a new intent.
    resource: tuple[str, ...] = ()
    key_configured: bool = False   # the configuration names a key rule
    # Where the mode comes from: "config", or (mode not configured) the upstream's
    # annotations: "readOnlyHint", "destructiveHint", "readOnlyHint=false", "no hints".
    mode_source: str = "config"
    mode_configured: bool = True

    @property
    def is_consequential(self) -> bool:
        return self.mode == CONSEQUENTIAL

    @property
    def uses_default_key(self) -> bool:
        return self.key_from in (KEY_FROM_SESSION, KEY_FROM_DEFAULT)


@dataclass(frozen=True)
class Config:
    path: str
    name: str
    tenant: str | None
    max_result_bytes: int
    upstream: Upstream
    tools: dict[str, Tool]
    max_forward_bytes: int = DEFAULT_MAX_FORWARD_BYTES
    # Refuse to start while a consequential tool has no key rule (instead of a warning).
    require_key_rule: bool = False
    # The provider account of every consequential tool that names none ("": none).
    account: str = ""

    def account_of(self, tool: Tool) -> str:
        """The provider account `tool`'s receipts name: its own, else the gateway's."""
        return self.account if tool.account is None else tool.account

    def tool(self, name: str) -> Tool:
        """The configuration of tool `name`: pass-through when it is not listed."""
        return self.tools.get(name) or Tool(name=name, mode_source="not listed",
                                           mode_configured=False)


# --- reading -----------------------------------------------------------------------------


def load(path: str | Path) -> Config:
    """Read and check the file; ConfigError for anything that cannot be used."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"expected a readable gateway configuration at {path}, found "
                          f"{type(exc).__name__}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: expected TOML, found a syntax error: {exc}") from None
    return parse(data, source=str(path), base=path.resolve().parent)


def parse(data: dict[str, Any], *, source: str = "<config>", base: Path | None = None) -> Config:
    t = _Table(data, "top level", source)
    t.only({"gateway", "upstream", "tools"})
    gateway = _Table(t.get("gateway", dict, {}), "[gateway]", source)
    gateway.only({"name", "tenant", "max_result_bytes", "max_forward_bytes",
                  "require_key_rule", "account"})
    name = gateway.get("name", str, "upstream")
    if not _PATH.fullmatch(name):
        gateway.fail("name", "letters, digits, '_' or '-'", repr(name))
    tenant = gateway.get("tenant", str, None)
    max_result = gateway.get("max_result_bytes", int, DEFAULT_MAX_RESULT_BYTES)
    if max_result < 1:
        gateway.fail("max_result_bytes", "a positive number of bytes", max_result)
    require_key_rule = gateway.get("require_key_rule", bool, False)
    account = _account(gateway, "")
    max_forward = gateway.get("max_forward_bytes", int, DEFAULT_MAX_FORWARD_BYTES)
    if max_forward < 1:
        gateway.fail("max_forward_bytes", "a positive number of bytes", max_forward)
    upstream = _upstream(_Table(t.require("upstream", dict), "[upstream]", source), base)
    tools_table = _Table(t.get("tools", dict, {}), "[tools]", source)
    tools = {}
    for tool_name, raw in tools_table.data.items():
        if not isinstance(raw, dict):
            tools_table.fail(tool_name, "a table", type(raw).__name__)
        tools[tool_name] = _tool(tool_name, _Table(raw, f"[tools.{tool_name}]", source), name)
    return Config(path=source, name=name, tenant=tenant, max_result_bytes=max_result,
                  upstream=upstream, tools=tools, max_forward_bytes=max_forward,
                  require_key_rule=require_key_rule, account=account)


def _upstream(t: _Table, base: Path | None) -> Upstream:
    t.only({"command", "url", "env", "cwd", "headers", "connect_timeout", "protocol"})
    command = t.get("command", list, None)
    url = t.get("url", str, None)
    if (command is None) == (url is None):
        t.fail("command / url", "exactly one of them (a command over stdio, or a Streamable "
               "HTTP URL)", "both" if command is not None else "neither")
    if command is not None and (
            not command or not all(isinstance(part, str) and part for part in command)):
        t.fail("command", "a non-empty list of non-empty strings", command)
    if url is not None and not re.match(r"https?://", url):
        t.fail("url", "an http:// or https:// URL", repr(url))
    env = t.get("env", dict, {})
    headers = t.get("headers", dict, {})
    for key_name, mapping in (("env", env), ("headers", headers)):
        for k, v in mapping.items():
            if not isinstance(v, str):
                t.fail(f"{key_name}.{k}", "a string", type(v).__name__)
    protocol = t.get("protocol", str, "auto")
    if protocol not in UPSTREAM_PROTOCOLS:
        t.fail("protocol", f"one of {list(UPSTREAM_PROTOCOLS)}", repr(protocol))
    cwd = t.get("cwd", str, None)
    if cwd is not None and base is not None and not Path(cwd).is_absolute():
        cwd = str(base / cwd)
    return Upstream(command=tuple(command or ()), url=url or "", env=env, cwd=cwd,
                    headers=headers, connect_timeout=_seconds(t, "connect_timeout", 30.0),
                    protocol=protocol)


def _tool(name: str, t: _Table, gateway_name: str) -> Tool:
    t.only({"mode", "operation", "target", "key", "keep", "redact", "external_id",
            "external_id_template", "timeout", "retry_policy", "approval_wait", "in_flight",
            "reconcile", "on_error", "rejected_when", "unknown_when", "error_code",
            "retry_window", "repeat", "resource", "account"})
    mode = t.get("mode", str, None)
    if mode is not None and mode not in (PASS_THROUGH, CONSEQUENTIAL):
        t.fail("mode", f"{PASS_THROUGH!r} or {CONSEQUENTIAL!r}", repr(mode))
    settings = sorted(set(t.data) - {"mode"})
    if mode == PASS_THROUGH:
        if settings:
            t.fail(settings[0], f"nothing but mode for a {PASS_THROUGH} tool (its calls are "
                   "forwarded as they are)", "a setting of consequential tools")
        return Tool(name=name)
    if mode is None and not settings:
        # Listed without a mode or settings: the upstream's annotations decide.
        return Tool(name=name, mode_source="no hints", mode_configured=False)
    operation = t.get("operation", str, default_operation(gateway_name, name))
    try:
        check_operation_name(operation)
    except ValueError as exc:
        t.fail("operation", "an operation name like 'invoices.create'", str(exc))
    target = t.get("target", str, f"mcp://{gateway_name}/{name}")
    key = _Table(t.get("key", dict, {}), f"[tools.{name}.key]", t.source)
    key.only({"from", "names"})
    key_from = key.get("from", str, KEY_FROM_SESSION)
    if key_from not in (KEY_FROM_SESSION, KEY_FROM_DEFAULT, KEY_FROM_ARGUMENTS,
                        KEY_FROM_META):
        key.fail("from", f"one of {KEY_FROM_SESSION!r} (or {KEY_FROM_DEFAULT!r}), "
                 f"{KEY_FROM_ARGUMENTS!r}, {KEY_FROM_META!r}", repr(key_from))
    names = key.get("names", list, [])
    if key_from == KEY_FROM_ARGUMENTS and not names:
        key.fail("names", "the argument names the key is made of (from = 'arguments')",
                 "none")
    if key_from != KEY_FROM_ARGUMENTS and names:
        key.fail("names", f"no names with from = {key_from!r}", names)
    keep = t.get("keep", list, None)
    redact = t.get("redact", list, [])
    resource = t.get("resource", list, [])
    repeat = t.get("repeat", str, None)
    if repeat is not None and repeat not in (REPEAT_SEND, REPEAT_ASK):
        t.fail("repeat", f"{REPEAT_SEND!r} or {REPEAT_ASK!r}", repr(repeat))
    for key_name, paths in (("keep", keep or []), ("redact", redact),
                            ("key.names", names), ("resource", resource)):
        for p in paths:
            if not isinstance(p, str) or not _PATH.fullmatch(p):
                t.fail(key_name, "a list of argument names or dotted paths", repr(p))
    external_id = t.get("external_id", str, "")
    external_id_template = t.get("external_id_template", str, "")
    if external_id and external_id_template:
        t.fail("external_id / external_id_template", "at most one of them", "both")
    if external_id and not _PATH.fullmatch(external_id):
        t.fail("external_id", "a dotted path into the structured result, e.g. 'invoice.id'",
               repr(external_id))
    if external_id_template:
        _check_template(t, "external_id_template", external_id_template, keep)
    retry_policy = t.get("retry_policy", str, RetryPolicy.IF_ABSENT_PROVEN)
    if retry_policy not in RetryPolicy.values:
        t.fail("retry_policy", f"one of {sorted(RetryPolicy.values)}", repr(retry_policy))
    account = _account(t, None)
    in_flight = t.get("in_flight", (int, float), None)
    if in_flight is not None and not 0 < in_flight <= 7 * 86400:
        t.fail("in_flight", "seconds, more than 0 and at most 7 days", in_flight)
    approval_wait = _seconds(t, "approval_wait", 0.0, allow_zero=True, high=86400)
    on_error = t.get("on_error", str, ON_ERROR_REJECTED)
    if on_error not in (ON_ERROR_REJECTED, ON_ERROR_UNKNOWN):
        t.fail("on_error", f"{ON_ERROR_REJECTED!r} or {ON_ERROR_UNKNOWN!r}", repr(on_error))
    patterns = {}
    for setting in ("rejected_when", "unknown_when"):
        patterns[setting] = t.get(setting, list, [])
        for pattern in patterns[setting]:
            if not isinstance(pattern, str) or not pattern:
                t.fail(setting, "a list of regular expressions", repr(pattern))
            try:
                re.compile(pattern)
            except re.error as exc:
                t.fail(setting, "a list of regular expressions", f"{pattern!r} ({exc})")
    error_code = t.get("error_code", str, "")
    if error_code and not _PATH.fullmatch(error_code):
        t.fail("error_code", "a dotted path into the structured result of a tool error",
               repr(error_code))
    retry_window = _seconds(t, "retry_window", DEFAULT_RETRY_WINDOW, allow_zero=True,
                            high=86400)
    reconcile_raw = t.get("reconcile", dict, None)
    reconcile = None
    if reconcile_raw is not None:
        reconcile = _reconcile(_Table(reconcile_raw, f"[tools.{name}.reconcile]", t.source),
                               keep)
    return Tool(
        name=name, mode=CONSEQUENTIAL, operation=operation, target=target, key_from=key_from,
        key_names=tuple(names), keep=None if keep is None else tuple(keep),
        redact=tuple(redact), external_id=external_id,
        external_id_template=external_id_template,
        timeout=_seconds(t, "timeout", DEFAULT_TIMEOUT), retry_policy=retry_policy,
        approval_wait=approval_wait, in_flight=None if in_flight is None else float(in_flight),
        reconcile=reconcile, on_error=on_error,
        rejected_when=tuple(patterns["rejected_when"]),
        unknown_when=tuple(patterns["unknown_when"]), error_code=error_code,
        retry_window=retry_window, repeat=repeat, resource=tuple(resource), account=account,
        key_configured="key" in t.data, mode_configured=mode is not None,
        mode_source="config" if mode is not None else "settings",
    )


def _account(t: _Table, default: str | None) -> str | None:
    """`account`: a provider account label as the ledger takes it (a short name, no control
    characters or surrounding spaces; "" for none)."""
    account = t.get("account", str, default)
    if account:
        try:
            check_identifier(account, "account", 200)
        except InvalidInput:
            t.fail("account", "a provider account label (at most 200 characters, no control "
                   "characters, no surrounding spaces)", repr(account)[:220])
    return account


def default_operation(gateway_name: str, tool_name: str) -> str:
    """The operation name of a consequential tool that names none: '<gateway>.<tool>'."""
    return f"{gateway_name}.{tool_name}"


def _reconcile(t: _Table, keep: list[str] | None) -> Reconcile:
    t.only({"tool", "arguments", "found", "absent", "not_yet", "external_id",
            "external_id_template", "timeout"})
    tool = t.require("tool", str)
    arguments = t.get("arguments", dict, {})
    for arg, value in arguments.items():
        if isinstance(value, str):
            _check_template(t, f"arguments.{arg}", value, keep)
    rules = {}
    for verdict in ("found", "absent", "not_yet"):
        raw = t.get(verdict, dict, None) if verdict != "found" else t.require("found", dict)
        rules[verdict] = None if raw is None else _rule(
            _Table(raw, f"{t.where[:-1]}.{verdict}]", t.source), keep)
    external_id = t.get("external_id", str, "")
    template = t.get("external_id_template", str, "")
    if bool(external_id) == bool(template):
        t.fail("external_id / external_id_template", "exactly one (Found needs the effect's "
               "id: a path into the read's structured result, or a template over the "
               "original call's arguments)", "both" if external_id else "neither")
    if external_id and not _PATH.fullmatch(external_id):
        t.fail("external_id", "a dotted path into the structured result", repr(external_id))
    if template:
        _check_template(t, "external_id_template", template, keep)
    return Reconcile(tool=tool, arguments=arguments, found=rules["found"],
                     absent=rules["absent"], not_yet=rules["not_yet"],
                     external_id=external_id, external_id_template=template,
                     timeout=_seconds(t, "timeout", DEFAULT_TIMEOUT))


def _rule(t: _Table, keep: list[str] | None) -> Rule:
    t.only({"path", "equals", "one_of", "exists", "matches", "text_matches", "is_error"})
    if not t.data:
        t.fail("(any)", "at least one condition: path with equals / one_of / exists / "
               "matches, text_matches or is_error", "an empty table")
    path = t.get("path", str, "")
    if path and not _PATH.fullmatch(path):
        t.fail("path", "a dotted path into the structured result", repr(path))
    has_value_test = any(k in t.data for k in ("equals", "one_of", "exists", "matches"))
    if has_value_test and not path:
        t.fail("path", "the path the value conditions apply to", "none")
    if path and not has_value_test:
        t.fail("path", "a condition on it (equals, one_of, exists or matches)", "none")
    equals = t.data.get("equals")
    if isinstance(equals, str):
        _check_template(t, "equals", equals, keep)
    for name in ("matches", "text_matches"):
        pattern = t.get(name, str, "")
        if pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                t.fail(name, "a regular expression", f"{pattern!r} ({exc})")
    return Rule(path=path, equals=equals, one_of=tuple(t.get("one_of", list, [])),
                exists=t.get("exists", bool, None), matches=t.get("matches", str, ""),
                text_matches=t.get("text_matches", str, ""),
                is_error=t.get("is_error", bool, None))


def _check_template(t: _Table, key: str, template: str, keep: list[str] | None) -> None:
    """A template may name only arguments the receipt stores (with `keep`, those kept):
    the reconciler works from the receipt, never from the call it did not see."""
    for name in _TEMPLATE.findall(template):
        if keep is not None and not any(name == k or name.startswith(k + ".") for k in keep):
            t.fail(key, f"a template over stored arguments (keep = {keep})",
                   f"{{{name}}}, which is not kept")


def _seconds(t: _Table, key: str, default: float, *, allow_zero: bool = False,
             high: float = 3600) -> float:
    value = t.get(key, (int, float), default)
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or value > high:
        t.fail(key, f"seconds, {'from 0' if allow_zero else 'more than 0'} to {high:g}", value)
    return float(value)


class _Table:
    def __init__(self, data: dict[str, Any], where: str, source: str):
        self.data, self.where, self.source = data, where, source

    def fail(self, key: str, expected: str, found: Any):
        raise ConfigError(f"{self.source}: {self.where} {key}: expected {expected}, found "
                          f"{found}")

    def only(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(key, f"one of the keys {sorted(allowed)}", f"unknown key {key!r}")

    def require(self, key: str, kind):
        if key not in self.data:
            self.fail(key, _kind_name(kind), "nothing (it is required)")
        return self.get(key, kind, None)

    def get(self, key: str, kind, default):
        if key not in self.data:
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            self.fail(key, _kind_name(kind), repr(value))
        if not isinstance(value, kinds):
            self.fail(key, _kind_name(kind), f"{type(value).__name__} {value!r}"[:200])
        return value


def _kind_name(kind) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list",
             dict: "a table", bool: "true or false"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


# --- checks against the upstream's tool list ---------------------------------------------


def check_against_tools(config: Config, tools: dict[str, dict[str, Any]]) -> None:
    """`tools`: name -> inputSchema, as the upstream listed them. Every configured tool (and
    reconciler's read tool) must exist, and the arguments a key, `keep` or a read's template
    names must be properties of its input schema when the schema lists properties."""
    listed = sorted(tools)
    for tool in config.tools.values():
        where = f"{config.path}: [tools.{tool.name}]"
        if tool.name not in tools:
            raise ConfigError(f"{where}: expected tool {tool.name!r} among the upstream's "
                              f"tools {listed}, found none")
        if not tool.is_consequential:
            continue
        props = _properties(tools[tool.name])
        for what, paths in (("key.names", tool.key_names), ("keep", tool.keep or ()),
                            ("resource", tool.resource)):
            for p in paths:
                top = p.split(".")[0]
                if props is not None and top not in props:
                    raise ConfigError(
                        f"{where} {what}: expected argument {top!r} in the input schema "
                        f"the upstream declares for {tool.name} (properties {sorted(props)}), "
                        "found none")
        if tool.reconcile is not None:
            read = tool.reconcile.tool
            if read not in tools:
                raise ConfigError(f"{where[:-1]}.reconcile] tool: expected {read!r} among "
                                  f"the upstream's tools {listed}, found none")
            read_props = _properties(tools[read])
            for arg in tool.reconcile.arguments:
                if read_props is not None and arg not in read_props:
                    raise ConfigError(
                        f"{where[:-1]}.reconcile] arguments.{arg}: expected an argument of "
                        f"{read} (properties {sorted(read_props)}), found none")


def classify_error(tool: Tool, text: str, structured: Any) -> str:
    """ON_ERROR_REJECTED or ON_ERROR_UNKNOWN for a tool error of `tool`: its text (and the
    code at `error_code`, when configured) against rejected_when, then unknown_when, else
    the tool's `on_error`."""
    seen = text
    if tool.error_code and isinstance(structured, dict):
        code = lookup(structured, tool.error_code)
        if code is not MISSING:
            seen = f"{code}\n{text}"
    if any(re.search(p, seen) for p in tool.rejected_when):
        return ON_ERROR_REJECTED
    if any(re.search(p, seen) for p in tool.unknown_when):
        return ON_ERROR_UNKNOWN
    return tool.on_error


def _properties(schema: Any) -> set[str] | None:
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        return set(schema["properties"])
    return None


# --- templates and paths -----------------------------------------------------------------

_MISSING = object()


def lookup(value: Any, path: str) -> Any:
    """The value at dotted `path` (list items by index), or `MISSING`."""
    current = value
    for part in path.split("."):
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return _MISSING
    return current


MISSING = _MISSING


def render(template: Any, arguments: dict[str, Any]) -> Any:
    """A template over `arguments`: "{name}" alone gives the value itself (any JSON type);
    inside other text, its text. A name that is not there raises KeyError."""
    if not isinstance(template, str):
        return template
    whole = _TEMPLATE.fullmatch(template)
    if whole:
        found = lookup(arguments, whole[1])
        if found is MISSING:
            raise KeyError(whole[1])
        return found

    def one(match: re.Match) -> str:
        found = lookup(arguments, match[1])
        if found is MISSING:
            raise KeyError(match[1])
        return found if isinstance(found, str) else str(found)

    return _TEMPLATE.sub(one, template)


# --- the upstream's annotations ----------------------------------------------------------

HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint")


def resolve(config: Config, annotations: dict[str, dict[str, Any]]) -> Config:
    """The configuration with every upstream tool's mode and repeat rule decided.

    `annotations`: name -> the hints the upstream declares for it (readOnlyHint,
    destructiveHint, idempotentHint; absent when it declares none). What the configuration
    says wins; for a tool it lists without a mode (or does not list): readOnlyHint true
    passes through; destructiveHint true, or readOnlyHint false, makes it consequential
    (operation '<gateway>.<tool>', the default key); no hints: pass-through. The default
    key's `repeat` (when not configured): "ask" for a tool whose idempotentHint is false
    (a second call would be a second effect), else "send"."""
    tools = dict(config.tools)
    for name, hints in annotations.items():
        tool = tools.get(name) or config.tool(name)
        if not tool.mode_configured and tool.mode_source not in ("settings",):
            if hints.get("readOnlyHint") is True:
                tool = _replace(tool, mode=PASS_THROUGH, mode_source="readOnlyHint")
            elif hints.get("destructiveHint") is True:
                tool = _auto(config, name, "destructiveHint")
            elif hints.get("readOnlyHint") is False:
                tool = _auto(config, name, "readOnlyHint=false")
            else:
                tool = _replace(tool, mode=PASS_THROUGH, mode_source=(
                    "no hints" if name in config.tools else "not listed, no hints"))
        if tool.is_consequential and tool.repeat is None:
            idempotent = hints.get("idempotentHint")
            tool = _replace(tool, repeat=REPEAT_ASK if idempotent is False else REPEAT_SEND)
        tools[name] = tool
    return Config(path=config.path, name=config.name, tenant=config.tenant,
                  max_result_bytes=config.max_result_bytes, upstream=config.upstream,
                  tools=tools, max_forward_bytes=config.max_forward_bytes,
                  require_key_rule=config.require_key_rule, account=config.account)


def _auto(config: Config, name: str, source: str) -> Tool:
    operation = default_operation(config.name, name)
    try:
        check_operation_name(operation)
    except ValueError as exc:
        raise ConfigError(f"{config.path}: [tools.{name}]: expected a tool name that makes an "
                          f"operation name ({source} makes it consequential), found "
                          f"{exc}; list it with an operation") from None
    return Tool(name=name, mode=CONSEQUENTIAL, operation=operation,
                target=f"mcp://{config.name}/{name}", mode_source=source,
                mode_configured=False)


def _replace(tool: Tool, **changes) -> Tool:
    from dataclasses import replace
    return replace(tool, **changes)


def check_key_rules(config: Config) -> None:
    """With `[gateway] require_key_rule = true`: ConfigError while any consequential tool
    (configured, or made so by its annotations) has no key rule."""
    if not config.require_key_rule:
        return
    missing = [t.name for t in config.tools.values()
               if t.is_consequential and t.uses_default_key and not t.key_configured]
    if missing:
        raise ConfigError(
            f"{config.path}: [gateway] require_key_rule: expected a key rule (key = {{ from "
            f"= \"arguments\", names = [...] }}, or {{ from = \"meta\" }}, or {{ from = "
            f"\"default\" }} to accept the default) for every consequential tool, found "
            f"none for {missing}")


def warnings(config: Config) -> list[str]:
    """One line per consequential tool without a key rule (said at start): the default key
    decides what a retry is."""
    out = []
    for tool in config.tools.values():
        if tool.is_consequential and tool.uses_default_key and not tool.key_configured:
            otherwise = ("refused until the client sends its own key (repeat = \"ask\")"
                         if tool.repeat == REPEAT_ASK else "sent as a new call")
            out.append(
                f"warning: {config.path}: [tools.{tool.name}] is consequential "
                f"({tool.mode_source}) without a key rule: the default key takes a call "
                f"with the same arguments for a retry only within retry_window = "
                f"{tool.retry_window:g} s of the last one, with no other call of the tool"
                f"{' or on its resource' if tool.resource else ''} between; otherwise it is "
                f"{otherwise}. Set key = {{ from = \"arguments\", names = [...] }}, or have "
                f"the client send _meta[{META_KEY!r}]")
    return out


def table(config: Config, annotations: dict[str, dict[str, Any]]) -> str:
    """The resolved configuration of every upstream tool, one line each, for `--check`."""
    rows = [("tool", "hints", "mode", "because", "operation", "key", "repeat")]
    for name in sorted(annotations):
        hints = annotations[name]
        tool = config.tool(name)
        shown = ",".join(f"{h[:-4]}={'yes' if hints[h] else 'no'}" for h in HINTS
                         if h in hints) or "-"
        if tool.is_consequential:
            if tool.key_from == KEY_FROM_ARGUMENTS:
                key = "arguments " + ",".join(tool.key_names)
            elif tool.key_from == KEY_FROM_META:
                key = "meta"
            else:
                key = f"default ({tool.retry_window:g} s)"
            rows.append((name, shown, "receipted", tool.mode_source, tool.operation, key,
                         (tool.repeat or REPEAT_SEND) if tool.uses_default_key else "-"))
        else:
            rows.append((name, shown, "pass-through", tool.mode_source, "-", "-", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)

"""The gateway's TOML configuration: every mistake is refused naming the table and key,
what was expected and what was found; the examples in examples/gateway/ are valid."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from api.gateway import config as cfg

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
[upstream]
command = ["python", "server.py"]

[tools.create_invoice]
mode = "consequential"
operation = "invoices.create"
keep = ["customer", "reference"]
external_id = "id"

[tools.create_invoice.reconcile]
tool = "find_invoice"
arguments = { reference = "{reference}" }
found = { path = "status", equals = "found" }
absent = { path = "status", equals = "absent" }
external_id = "invoice.id"
"""


def parse(text: str) -> cfg.Config:
    return cfg.parse(tomllib.loads(text), source="g.toml")


def test_a_good_configuration_reads_with_its_defaults():
    config = parse(GOOD)
    tool = config.tools["create_invoice"]
    assert tool.is_consequential and tool.key_from == "session"
    assert tool.target == "mcp://upstream/create_invoice" and tool.timeout == 30.0
    assert tool.reconcile.found == cfg.Rule(path="status", equals="found")
    assert config.tool("find_invoice").mode == "pass-through"  # unlisted: forwarded as is
    assert config.upstream.protocol == "auto"  # 2026-07-28 or the handshake, as negotiated


@pytest.mark.parametrize(("change", "message"), [
    (("[upstream]\ncommand", "[upstream]\nurl = \"ftp://x\"\ncommand"),
     "[upstream] command / url: expected exactly one of them"),
    (("[upstream]\ncommand", "[upstream]\nprotocol = \"2025-11-25\"\ncommand"),
     "[upstream] protocol: expected one of ['auto', '2026-07-28', 'legacy'], found "
     "'2025-11-25'"),
    (('mode = "consequential"', 'mode = "sometimes"'),
     "[tools.create_invoice] mode: expected 'pass-through' or 'consequential', found "
     "'sometimes'"),
    (('operation = "invoices.create"', 'operation = "invoices create"'),
     "[tools.create_invoice] operation: expected an operation name like 'invoices.create'"),
    (('external_id = "id"', 'external_id = "id"\nrepeat = "never"'),
     "[tools.create_invoice] repeat: expected 'send' or 'ask', found 'never'"),
    (('external_id = "id"', 'external_id = "id"\nresource = ["a b"]'),
     "[tools.create_invoice] resource: expected a list of argument names or dotted paths"),
    (('external_id = "id"', 'external_id = "id"\nkey = { from = "arguments" }'),
     "[tools.create_invoice.key] names: expected the argument names the key is made of"),
    (('external_id = "id"', 'external_id = "id"\ntimeout = -1'),
     "[tools.create_invoice] timeout: expected seconds, more than 0 to 3600, found -1"),
    (('external_id = "id"', 'external_id = "id"\ntimout = 5'),
     "[tools.create_invoice] timout: expected one of the keys"),
    (('arguments = { reference = "{reference}" }', 'arguments = { amount = "{amount}" }'),
     "[tools.create_invoice.reconcile] arguments.amount: expected a template over stored "
     "arguments (keep = ['customer', 'reference']), found {amount}, which is not kept"),
    (('external_id = "invoice.id"', ""),
     "[tools.create_invoice.reconcile] external_id / external_id_template: expected exactly "
     "one"),
    (('found = { path = "status", equals = "found" }', 'found = { path = "status" }'),
     "[tools.create_invoice.reconcile.found] path: expected a condition on it"),
    (('absent = { path = "status", equals = "absent" }', 'absent = { text_matches = "(" }'),
     "[tools.create_invoice.reconcile.absent] text_matches: expected a regular expression"),
    (('external_id = "id"', 'external_id = "id"\non_error = "retry"'),
     "[tools.create_invoice] on_error: expected 'rejected' or 'unknown', found 'retry'"),
    (('external_id = "id"', 'external_id = "id"\nunknown_when = ["503", "("]'),
     "[tools.create_invoice] unknown_when: expected a list of regular expressions, found '('"),
    (('external_id = "id"', 'external_id = "id"\nretry_window = -1'),
     "[tools.create_invoice] retry_window: expected seconds, from 0 to 86400, found -1"),
    (('external_id = "id"', 'external_id = "id"\naccount = " acct_1"'),
     "[tools.create_invoice] account: expected a provider account label (at most 200 "
     "characters, no control characters, no surrounding spaces), found ' acct_1'"),
    (("[upstream]\ncommand", "[gateway]\naccount = 7\n[upstream]\ncommand"),
     "[gateway] account: expected a string, found int"),
])
def test_each_mistake_names_its_table_key_expected_and_found(change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(cfg.ConfigError) as refused:
        parse(GOOD.replace(old, new, 1))
    assert str(refused.value).startswith("g.toml: ")
    assert message in str(refused.value)


def test_the_provider_account_is_the_tool_s_own_else_the_gateway_s():
    config = parse('[gateway]\naccount = "acct_main"\n' + GOOD + """
[tools.refund]
mode = "consequential"
account = "acct_refunds"
""")
    assert config.account_of(config.tools["create_invoice"]) == "acct_main"
    assert config.account_of(config.tools["refund"]) == "acct_refunds"
    assert parse(GOOD).account_of(parse(GOOD).tools["create_invoice"]) == ""


def test_a_pass_through_tool_takes_no_settings():
    with pytest.raises(cfg.ConfigError, match=r"\[tools.x\] operation: expected nothing but "
                       "mode for a pass-through tool"):
        parse('[upstream]\nurl = "http://h/mcp"\n[tools.x]\nmode = "pass-through"\n'
              'operation = "a.b"\n')
    # Settings without a mode: consequential, as the settings say.
    tool = parse('[upstream]\nurl = "http://h/mcp"\n[tools.x]\ntimeout = 5\n').tools["x"]
    assert tool.is_consequential and tool.operation == "upstream.x"


def test_a_file_that_is_not_toml_or_not_there_is_refused(tmp_path):
    with pytest.raises(cfg.ConfigError, match="expected a readable gateway configuration"):
        cfg.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[upstream\n")
    with pytest.raises(cfg.ConfigError, match="expected TOML, found a syntax error"):
        cfg.load(bad)


def test_the_configuration_is_checked_against_the_upstreams_tools():
    config = parse(GOOD)
    schema = {"type": "object", "properties": {"customer": {}, "reference": {}}}
    cfg.check_against_tools(config, {"create_invoice": schema, "find_invoice": {
        "type": "object", "properties": {"reference": {}}}})
    with pytest.raises(cfg.ConfigError, match="expected tool 'create_invoice' among the "
                       r"upstream's tools \['find_invoice'\], found none"):
        cfg.check_against_tools(config, {"find_invoice": {}})
    with pytest.raises(cfg.ConfigError, match="keep: expected argument 'reference' in the "
                       "input schema"):
        cfg.check_against_tools(config, {"create_invoice": {
            "type": "object", "properties": {"customer": {}}}, "find_invoice": {}})


def test_templates_keep_the_type_of_a_whole_value():
    assert cfg.render("{n}", {"n": 3}) == 3
    assert cfg.render("file {a.b}", {"a": {"b": "x"}}) == "file x"
    with pytest.raises(KeyError):
        cfg.render("{missing}", {})


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples" / "gateway")
                                        .glob("*.toml")))
def test_the_example_configurations_are_valid(name):
    config = cfg.load(ROOT / "examples" / "gateway" / name)
    assert any(t.is_consequential and t.reconcile for t in config.tools.values())


def test_tool_errors_are_rejected_unless_configured_as_unknown():
    """The default: a tool error (isError) says the upstream did nothing: rejected. Patterns
    on its text, or on a code in its structured result, may say it might have: unknown
    (the reconciler then proves it absent or present)."""
    default = parse(GOOD).tools["create_invoice"]
    assert default.on_error == "rejected" and default.retry_window == 30.0
    assert cfg.classify_error(default, "503 Service Unavailable", None) == "rejected"
    tool = parse(GOOD.replace('external_id = "id"', """external_id = "id"
unknown_when = ["^503 ", "(?i)timed out"]
rejected_when = ["nothing (was )?charged"]
error_code = "error.code"
""", 1)).tools["create_invoice"]
    assert cfg.classify_error(tool, "503 Service Unavailable", None) == "unknown"
    assert cfg.classify_error(tool, "503 Service Unavailable: nothing charged",
                              None) == "rejected"  # rejected_when is asked first
    assert cfg.classify_error(tool, "failed", {"error": {"code": "Timed out"}}) \
        == "unknown"
    assert cfg.classify_error(tool, "card declined", {"error": {"code": 402}}) == "rejected"
    everything = parse(GOOD.replace('external_id = "id"',
                                    'external_id = "id"\non_error = "unknown"', 1))
    assert cfg.classify_error(everything.tools["create_invoice"], "anything", None) \
        == "unknown"


FILESYSTEM_HINTS = {  # as @modelcontextprotocol/server-filesystem 2026.8.31 declares them
    "read_file": {"readOnlyHint": True},
    "write_file": {"readOnlyHint": False, "idempotentHint": True, "destructiveHint": True},
    "edit_file": {"readOnlyHint": False, "idempotentHint": False, "destructiveHint": True},
    "create_directory": {"readOnlyHint": False, "idempotentHint": True,
                         "destructiveHint": False},
    "list_allowed_directories": {},
}


def test_annotations_decide_what_the_configuration_does_not_say():
    """readOnlyHint passes through; destructiveHint (or readOnlyHint false) is receipted
    under the default key; idempotentHint false makes a same-arguments repeat ask for a
    key; what the configuration says wins; no hints: pass-through."""
    config = cfg.resolve(parse("""
[gateway]
name = "files"
[upstream]
command = ["node", "server.js"]
[tools.read_file]
mode = "consequential"
operation = "files.read"
key = { from = "meta" }
[tools.write_file]
mode = "pass-through"
"""), FILESYSTEM_HINTS)
    tools = config.tools
    assert (tools["read_file"].mode, tools["read_file"].mode_source) == (
        "consequential", "config")
    assert (tools["write_file"].mode, tools["write_file"].mode_source) == (
        "pass-through", "config")
    edit = tools["edit_file"]
    assert (edit.mode, edit.mode_source, edit.operation, edit.repeat, edit.key_from) == (
        "consequential", "destructiveHint", "files.edit_file", "ask", "session")
    directory = tools["create_directory"]
    assert (directory.mode, directory.mode_source, directory.repeat) == (
        "consequential", "readOnlyHint=false", "send")
    assert tools["list_allowed_directories"].mode == "pass-through"
    assert tools["list_allowed_directories"].mode_source == "not listed, no hints"

    table = cfg.table(config, FILESYSTEM_HINTS).splitlines()
    assert table[0].split() == ["tool", "hints", "mode", "because", "operation", "key",
                                "repeat"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows["edit_file"] == ["edit_file", "readOnly=no,destructive=yes,idempotent=no",
                                 "receipted", "destructiveHint", "files.edit_file",
                                 "default", "(30", "s)", "ask"]
    assert rows["write_file"][2:4] == ["pass-through", "config"]
    assert rows["list_allowed_directories"][1:3] == ["-", "pass-through"]

    warned = cfg.warnings(config)
    assert [line.split("[tools.")[1].split("]")[0] for line in warned] == [
        "edit_file", "create_directory"]
    assert "refused until the client sends its own key" in warned[0]
    assert "sent as a new call" in warned[1]


def test_a_configured_repeat_rule_wins_over_the_hint():
    config = cfg.resolve(parse(GOOD.replace('external_id = "id"',
                                            'external_id = "id"\nrepeat = "send"')),
                         {"create_invoice": {"idempotentHint": False}, "find_invoice": {}})
    assert config.tools["create_invoice"].repeat == "send"
    config = cfg.resolve(parse(GOOD), {"create_invoice": {"idempotentHint": False},
                                       "find_invoice": {}})
    assert config.tools["create_invoice"].repeat == "ask"

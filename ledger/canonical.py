"""Canonical JSON, redaction of secrets, and intent fingerprints.

Redaction happens before anything is stored: a value under a key that names a secret (at
any depth), or under a path the caller lists, is replaced by `REDACTED`, and credentials
inside any other text (`scrub_text`: URL userinfo, `api_key=` parameters, `Bearer` values,
token shapes such as `sk-...`, AWS key ids, JWTs, this ledger's own `alk_...` agent keys)
are replaced by it too, as are the value of a name/value pair whose name is a secret's
({"name": "X-Api-Key", "value": ...}), passwords in prose ("my password is ...", "pw: ...")
and payment card numbers (Luhn-checked). With `keep`, only the listed fields of an intent
are stored at all. The fingerprint is
computed from the redacted intent, so it can never depend on a secret.

`scrub_text` is the one scrubber: every text the ledger stores from an agent, a reconciler
or a person passes through it (or through `redact`, for JSON). Identifiers are not
scrubbed (operation names, idempotency keys, tenants, run, step and obligation ids, fact
subjects and predicates, lease owners): masking would merge distinct identities.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "[redacted]"

# A key is secret when one of its words is one of these (case and separators ignored):
# "X-Api-Key", "apiKey", "refresh_token", "Set-Cookie", "client_secret", "DB_PASSWORD" ...
_SECRET_WORDS = frozenset(
    {
        "authorization",
        "auth",
        "bearer",
        "cookie",
        "cookies",
        "credential",
        "credentials",
        "passphrase",
        "passwd",
        "password",
        "pwd",
        "secret",
        "token",
        "apikey",
        "signature",
        "session",
        "sessionid",
        "csrftoken",
    }
)
_SECRET_PAIRS = frozenset(
    {("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"), ("signing", "key")}
)
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: str) -> bool:
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub("_", key).lower()) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:], strict=False))


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant white space, UTF-8, no NaN or Infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


# --- credentials in free text ------------------------------------------------------------
#
# Applied to every string the ledger stores from an agent, a reconciler or a person: URL
# userinfo, `name=value` / `"name": value` pairs whose name is a secret by `is_secret_key`
# (query parameters, form bodies, headers, JSON or repr text), `Bearer`/`Basic` credentials,
# private key blocks and the token shapes of well-known issuers. Each pass replaces only
# the credential with REDACTED, so the result is stable under a second scrub.

# Names that mark a credential only as a query parameter (signed URLs: Azure SAS `sig`).
_SECRET_PARAMS = frozenset({"sig"})
_PEM_BLOCK = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
# scheme://user:password@host -> scheme://[redacted]@host (a bare `user@` stays).
_USERINFO = re.compile(r"(?P<scheme>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://)"
                       r"[^\s/?#@:\[\]\"'<>]*:[^\s/?#\"'<>]*@")
# (Set-)Cookie header lines: every cookie on the line is a credential.
_COOKIE_LINE = re.compile(r"(?i)(?<![\w-])((?:set-)?cookie\s*:[ \t]*)([^\r\n\"']+)")
# name=value, name: value, "name": "value" -- the name is checked by is_secret_key; the
# lookahead only spares that check to names that cannot be secrets.
_PAIR = re.compile(
    r"(?P<head>(?P<quote>[\"']?)(?<![\w.-])"
    r"(?P<name>(?=[\w.-]*(?i:auth|bearer|cookie|credential|pass|pwd|secret|token|key|sig|"
    r"session|csrf))[A-Za-z_][\w.-]*)(?P=quote)\s*[:=]\s*)"
    r"(?P<scheme>(?i:bearer|basic|token|digest)\s+)?"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s&;,\"'<>#]+)"
)
# Authorization schemes anywhere in text: `Bearer <credential>`, `Basic <credential>`.
_SCHEME = re.compile(r"(?P<head>\b(?:[Bb]earer|BEARER|[Bb]asic|BASIC)\s+)"
                     r"(?P<value>[A-Za-z0-9._~+/=-]+)")
_PLAIN_WORD = re.compile(r"^[A-Za-z][a-z]*$")
# Each shape starts only where a run of token characters starts, so text made of many
# near-misses ("sk-sk-sk-...") is read once, not once per near-miss.
_TOKEN_SHAPES = re.compile(
    r"(?<![\w-])(?:"
    r"sk-[A-Za-z0-9_-]{8,}"                         # OpenAI, Anthropic... (sk-proj-, sk-live-)
    r"|[sr]k_(?:live|test)_[A-Za-z0-9]{4,}"         # Stripe secret and restricted keys
    r"|whsec_[A-Za-z0-9]{8,}"                       # Stripe webhook secrets
    r"|(?:AKIA|ASIA)[A-Z0-9]{12,}"                   # AWS access key ids (16 after)
    r"|eyJ[\w-]{2,}\.eyJ[\w-]{2,}\.[\w-]*"           # JWTs (header.payload.signature)
    r"|gh[pousr]_[A-Za-z0-9]{10,}|github_pat_\w{10,}"  # GitHub tokens
    r"|xox[abposr]-[A-Za-z0-9-]{6,}"                 # Slack tokens
    r"|AIza[\w-]{30,}"                               # Google API keys
    r"|alk_[A-Za-z0-9_-]{20,}"                       # this ledger's own agent keys
    r")"
)
# A cheap first look: text without any of these holds nothing the passes would change.
_MAYBE_SECRET = re.compile(
    r"(?i)[=:@]|bearer|basic|sk-|[sr]k_|whsec_|akia|asia|eyj|gh[pousr]_|github_pat_|xox|aiza"
    r"|-----BEGIN|alk_|pass|pw|\d{4}[ -]?\d{4}"
)


# Passwords in prose: "my password is hunter2", "pw: hunter2", "the passcode was 1234".
# Words that read as the sentence going on ("password is required") are not credentials.
_PROSE_PASSWORD = re.compile(
    r"(?i)(?<![\w-])(?P<head>(?:password|passwd|passphrase|passcode|pwd|pw)"
    r"(?:\s*[:=]\s*|\s+(?:is|was|would be|will be)\s*:?\s*))"
    r"(?P<value>[^\s\"'<>]+)"
)
_NOT_A_PASSWORD = frozenset({
    "required", "incorrect", "invalid", "wrong", "expired", "missing", "empty", "correct",
    "not", "too", "set", "reset", "changed", "the", "a", "an", "still", "needed", "weak",
    "strong", "valid", "blank", "same", "different", "unknown", "hidden", "redacted",
})
_TRAILING = ".,;:!?)]}"
# A 13-19 digit number, maybe grouped by spaces or dashes, starting as a payment card's
# number does (2-6): the Luhn check then tells a card from an order number.
_CARD = re.compile(r"(?<![\w-])[2-6]\d{3}(?:[ -]?\d){9,15}(?![\w-])")
# {"name": "X-Api-Key", "value": "..."} written as text (JSON or a Python repr).
_NAMED_VALUE = re.compile(
    r"(?P<head>(?P<q>[\"'])(?:name|key|header|field)(?P=q)\s*:\s*(?P<qn>[\"'])"
    r"(?P<name>[^\"'\n]{1,100})(?P=qn)\s*,\s*(?P=q)(?:value|val|content)(?P=q)\s*:\s*)"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')"
)


def luhn_valid(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        n = int(char)
        if index % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _is_card_number(text: str) -> bool:
    digits = text.replace(" ", "").replace("-", "")
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits)


def _prose_password(match: re.Match) -> str:
    value = match["value"]
    if value.startswith(REDACTED):  # already scrubbed by an earlier pass ("password=[redacted]")
        return match[0]
    core = value.rstrip(_TRAILING)
    if not core or core.lower() in _NOT_A_PASSWORD or _is_redacted(core) or (
            core.startswith("/") and not match["head"].rstrip().endswith((":", "="))):
        return match[0]
    return match["head"] + REDACTED + value[len(core):]


def _named_value(match: re.Match) -> str:
    if not is_secret_key(match["name"]) or _is_redacted(match["value"]):
        return match[0]
    quote = match["value"][0]
    return f"{match['head']}{quote}{REDACTED}{quote}"


def _is_redacted(value: str) -> bool:
    return value.strip("\"'") == REDACTED


def _pairs(text: str) -> str:
    """`text` with the value of every pair whose name is a secret's (`_PAIR`) redacted.

    A pair whose name is not a secret's consumes nothing but its name: its value may start
    a pair of its own that runs past it ("x:y/Cookie: sessionid=..."), which a substitution
    would have skipped on this scrub and found on the next."""
    out, pos = [], 0
    while (match := _PAIR.search(text, pos)) is not None:
        name, value = match["name"], match["value"]
        if not (is_secret_key(name) or name.lower() in _SECRET_PARAMS):
            out.append(text[pos:match.end("head")])
            pos = match.end("head")
            continue
        out.append(text[pos:match.start()])
        if _is_redacted(value):
            out.append(match[0])
        else:
            quote = value[0] if value[0] in "\"'" else ""
            out.append(f"{match['head']}{match['scheme'] or ''}{quote}{REDACTED}{quote}")
        pos = match.end()
    out.append(text[pos:])
    return "".join(out)


def _scheme(match: re.Match) -> str:
    value = match["value"]
    # "Bearer tokens", "Basic Auth": a plain word is prose, not a credential.
    if _PLAIN_WORD.match(value):
        return match[0]
    return match["head"] + REDACTED


def _token_shape(match: re.Match) -> str:
    found = match[0]
    if found.startswith("sk-") and len(found) < 23 and not re.search(r"[0-9A-Z]", found[3:]):
        return found  # "sk-learn-pipeline": a short lowercase word, not a key
    return REDACTED


def scrub_text(text: Any) -> Any:
    """`text` with every credential it contains replaced by REDACTED; the same text twice.

    Ordinary text is left alone ("token bucket", "skeleton", a URL without credentials and
    its query). Anything but a string is returned as it is, for the input checks to refuse.
    """
    if not isinstance(text, str) or not _MAYBE_SECRET.search(text):
        return text
    text = _PEM_BLOCK.sub(REDACTED, text)
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    text = _COOKIE_LINE.sub(lambda m: m[1] + REDACTED, text)
    text = _pairs(text)
    text = _SCHEME.sub(_scheme, text)
    text = _NAMED_VALUE.sub(_named_value, text)
    text = _PROSE_PASSWORD.sub(_prose_password, text)
    text = _CARD.sub(lambda m: REDACTED if _is_card_number(m[0]) else m[0], text)
    return _TOKEN_SHAPES.sub(_token_shape, text)


def check_json(value: Any, *, what: str = "intent") -> Any:
    """`ledger.inputs.check_json`, where the gate lives (kept here for older imports)."""
    from ledger.inputs import check_json as gate

    return gate(value, what=what)


def redact(value: Any, paths: Iterable[str] = ()) -> Any:
    """A copy of `value` with secret-named keys and the dotted `paths` replaced by REDACTED,
    and every other string (keys too) passed through `scrub_text`.

    A path walks into every element of a list it meets: "items.card" redacts `card` in each
    element of `items`. Two keys that only differ in a credential become one key whose value
    is REDACTED, whatever their order, so the result (and a fingerprint of it) never depends
    on the credentials.
    """
    split_paths = [tuple(p.split(".")) for p in paths if p]
    return _redact(value, split_paths)


# A name/value pair as headers, form fields and parameters are often listed:
# {"name": "X-Api-Key", "value": "..."}: the value is secret when the name is a secret's.
_PAIR_NAMES = ("name", "key", "header", "field")
_PAIR_VALUES = frozenset({"value", "val", "content"})


def _secret_pair_name(value: Mapping) -> bool:
    return any(isinstance(value.get(name), str) and is_secret_key(value[name])
               for name in _PAIR_NAMES)


def _redact(value: Any, paths: list[tuple[str, ...]]) -> Any:
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, Mapping):
        named_secret = _secret_pair_name(value)
        out = {}
        for key, item in value.items():
            if is_secret_key(key) or (key,) in paths or (named_secret and key in _PAIR_VALUES):
                out[scrub_text(key)] = REDACTED
                continue
            deeper = [p[1:] for p in paths if len(p) > 1 and p[0] == key]
            clean = scrub_text(key)
            out[clean] = REDACTED if clean in out else _redact(item, deeper)
        return out
    if isinstance(value, (list, tuple)):
        if (len(value) == 2 and isinstance(value[0], str) and is_secret_key(value[0])
                and not isinstance(value[1], Mapping | list | tuple)):
            return [scrub_text(value[0]), REDACTED]  # ("Authorization", "...") header pairs
        return [_redact(item, paths) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and _is_card_number(str(value)):
        return REDACTED
    return value


def keep(value: Mapping[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """Only the dotted `paths` of `value`, in its shape: keep(["customer.id", "items.sku"])
    of {"customer": {"id": 7, "name": ...}, "items": [{"sku": "A", "note": ...}]} is
    {"customer": {"id": 7}, "items": [{"sku": "A"}]}. A path walks into every element of a
    list it meets (as `redact`'s do); a path that is not there keeps nothing."""
    return _keep(value, [tuple(p.split(".")) for p in paths if p])


def _keep(value: Any, paths: list[tuple[str, ...]]) -> Any:
    if any(not path for path in paths):
        return value  # the whole of it is kept
    if isinstance(value, list | tuple):
        return [_keep(item, paths) for item in value]
    if not isinstance(value, Mapping):
        return _DROPPED
    out = {}
    for key, item in value.items():
        deeper = [p[1:] for p in paths if p[0] == key]
        if deeper:
            kept = _keep(item, deeper)
            if kept is not _DROPPED:
                out[key] = kept
    return out


_DROPPED = object()


def select_fields(value: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The dotted `fields` of `value` that exist, keyed by their path."""
    selected: dict[str, Any] = {}
    for field in fields:
        current: Any = value
        for part in field.split("."):
            if isinstance(current, Mapping) and part in current:
                current = current[part]
            else:
                break
        else:
            selected[field] = current
    return selected


def fingerprint(redacted_intent: Mapping[str, Any], fields: Iterable[str] | None = None) -> str:
    """`sha256:<hex>` of the canonical JSON of the (allow-listed) redacted intent."""
    material = redacted_intent if fields is None else select_fields(redacted_intent, fields)
    digest = hashlib.sha256(canonical_json(material).encode("utf-8")).hexdigest()
    return f"sha256:{digest}"

"""Canonical JSON, redaction of secrets, and intent fingerprints.

Redaction happens before anything is stored: a value under a key that names a secret (at
any depth), or under a path the caller lists, is replaced by `REDACTED`, and credentials
inside any other text (`scrub_text`: URL userinfo, `api_key=` parameters, `Bearer` values,
token shapes such as `sk-...`, AWS key ids, JWTs) are replaced by it too. The fingerprint is
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
    r")"
)
# A cheap first look: text without any of these holds nothing the passes would change.
_MAYBE_SECRET = re.compile(
    r"(?i)[=:@]|bearer|basic|sk-|[sr]k_|whsec_|akia|asia|eyj|gh[pousr]_|github_pat_|xox|aiza"
    r"|-----BEGIN"
)


def _is_redacted(value: str) -> bool:
    return value.strip("\"'") == REDACTED


def _pair(match: re.Match) -> str:
    name, value = match["name"], match["value"]
    if is_secret_key(name) or name.lower() in _SECRET_PARAMS:
        if _is_redacted(value):
            return match[0]
        quote = value[0] if value[0] in "\"'" else ""
        return f"{match['head']}{match['scheme'] or ''}{quote}{REDACTED}{quote}"
    # Not a secret name: what follows it may still hold a pair of its own.
    head = match["head"]
    return head + _PAIR.sub(_pair, match[0][len(head):])


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
    text = _PAIR.sub(_pair, text)
    text = _SCHEME.sub(_scheme, text)
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


def _redact(value: Any, paths: list[tuple[str, ...]]) -> Any:
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if is_secret_key(key) or (key,) in paths:
                out[scrub_text(key)] = REDACTED
                continue
            deeper = [p[1:] for p in paths if len(p) > 1 and p[0] == key]
            clean = scrub_text(key)
            out[clean] = REDACTED if clean in out else _redact(item, deeper)
        return out
    if isinstance(value, (list, tuple)):
        return [_redact(item, paths) for item in value]
    return value


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

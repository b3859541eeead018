"""Canonical JSON, redaction of secrets, and intent fingerprints.

Redaction happens before anything is stored: a value under a key that names a secret (at
any depth), or under a path the caller lists, is replaced by `REDACTED`, and credentials
inside any other text (`scrub_text`: URL userinfo, secret-named pairs, `Bearer` values,
token shapes such as `sk-...`, AWS keys, JWTs, webhook paths, this ledger's own `alk_...`
agent keys) are replaced by it too, as are the value of a name/value pair whose name is a
secret's ({"name": "X-Api-Key", "value": ...}), passwords in prose in several languages,
payment card numbers (Luhn-checked), IBANs (check digits), US social security numbers, and
base64 of any of these. With `keep`, only the listed fields of an intent are stored at
all. The fingerprint is computed from the redacted intent, so it can never depend on a
secret.

`scrub_text` is the one scrubber: every text the ledger stores from an agent, a reconciler
or a person passes through it (or through `redact`, for JSON). Identifiers are not
scrubbed (operation names, idempotency keys, tenants, run, step and obligation ids, fact
subjects and predicates, lease owners): masking would merge distinct identities, so a
secret must never be put in one (docs/receipts.md says so).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import unicodedata
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
        "cvv",
        "cvv2",
        "cvc",
        "cvc2",
        "ssn",
    }
)
_SECRET_PAIRS = frozenset(
    {("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"), ("signing", "key"),
     ("account", "key"), ("ssh", "key")}
)
# Secret only as a key's last word: "pass", "db_pass", "userPass"; not "pass_count".
_SECRET_LAST_WORDS = frozenset({"pass"})
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: str) -> bool:
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub("_", key).lower()) if w]
    if any(w in _SECRET_WORDS for w in words) or (words and words[-1] in _SECRET_LAST_WORDS):
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
# (query parameters, form bodies, headers, JSON or repr text, percent-encoded), `Bearer`/
# `Basic` credentials, private key blocks, the token shapes of well-known issuers, bare AWS
# secret keys, webhook URLs' secret paths, passwords in prose (English, German, French,
# Spanish, Portuguese, Chinese, Japanese), payment card numbers, IBANs, US social security
# numbers, and base64 of any of these. Each pass replaces only the credential with REDACTED,
# so the result is stable under a second scrub.

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
# Words a secret's name contains; the lookaheads below only spare `is_secret_key` to names
# that cannot be secrets.
_NAME_HINT = (r"(?i:auth|bearer|cookie|credential|pass|pwd|secret|token|key|sig|session|csrf"
              r"|cvv|cvc|ssn)")
# name=value, name: value, "name": "value" -- the name is checked by is_secret_key.
_PAIR = re.compile(
    r"(?P<head>(?P<quote>[\"']?)(?<![\w.-])"
    rf"(?P<name>(?=[\w.-]*{_NAME_HINT})[A-Za-z_][\w.-]*)(?P=quote)\s*[:=]\s*)"
    r"(?P<scheme>(?i:bearer|basic|token|digest|ssh-rsa|ssh-ed25519|ssh-dss|ecdsa-sha2-[\w-]+)"
    r"\s+)?"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s&;,\"'<>#]+)"
)
# The same pair percent-encoded inside a URL's parameter: `next=%2Flogin%3Fpassword%3DX%26`.
_ENCODED_PAIR = re.compile(
    r"(?:(?<![\w.%-])|(?<=%[0-9A-Fa-f]{2}))"
    rf"(?P<name>(?=[\w.-]*{_NAME_HINT})[A-Za-z_][\w.-]*)%3[Dd]"
    r"(?P<value>(?:[^\s&;,\"'<>#%]|%(?!26|3[Bb])[0-9A-Fa-f]{2})+)"
)
# A secret's name as a config file or a command line writes it, without `=`:
# `aws_secret_access_key wJalr...`, `aws configure set aws_secret_access_key X`.
_NAME_SPACE_VALUE = re.compile(
    r"(?<![\w.-])(?P<head>(?P<name>[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+)[ \t]+)"
    r"(?P<value>[^\s\"'<>=:][^\s\"'<>]*)"
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
    r"|ya29\.[\w-]{16,}"                             # Google OAuth access tokens
    r"|glpat-[\w-]{16,}"                             # GitLab personal access tokens
    r"|hf_[A-Za-z0-9]{20,}"                          # Hugging Face tokens
    r"|npm_[A-Za-z0-9]{30,}"                         # npm tokens
    r"|SG\.[\w-]{16,}\.[\w-]{16,}"                   # SendGrid API keys
    r"|alk_[A-Za-z0-9_-]{20,}"                       # this ledger's own agent keys
    r")"
)
# An AWS secret access key on its own: 40 characters of base64 with upper and lower case
# letters and a digit (a hex digest, upper or lower case, lacks one of them).
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=_-])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=_-])")
# Webhook URLs whose path is the credential.
_WEBHOOK = re.compile(
    r"(?P<head>(?i:hooks\.slack\.com)/(?:services|workflows|triggers)/"
    r"|(?i:discord(?:app)?\.com)/api/webhooks/)(?P<value>[A-Za-z0-9_/+-]+)"
)
# A run that may be base64 (standard or URL-safe): decoded, it is scrubbed as text.
_BASE64 = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/_-]{16,}={0,2}(?![A-Za-z0-9+/=_-])")
# A cheap first look (`in` on the lower-cased text, then two small patterns, each only
# where it can match): text without any of these holds nothing the passes would change.
# Text that is not ASCII always gets the full look (CJK prose, full-width and zero-width
# characters). A loop of `in` tests is quicker than one alternation of the literals, which
# Python's `re` tries at every position (bench P1: 50 us against 13 us for 400 characters).
_HINTS = ("=", ":", "@", "bearer", "basic", "sk-", "sk_", "rk_", "whsec_", "akia", "asia",
          "eyj", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xox", "aiza",
          "-----begin", "alk_", "pass", "pw", "ya29.", "glpat-", "hf_", "npm_", "sg.", "hooks",
          "kennwort", "contrase", "senha", "cvv", "cvc", "ssn", "_key", "%3d",
          # a secret's name before its value without `=` (`refresh_token X`): is_secret_key
          "auth", "token", "secret", "cookie", "credential", "session", "csrf", "signature",
          "apikey")
_DIGIT_HINT = re.compile(r"\d{4}[ .-]?\d{4}|[A-Z]{2}\d{2}|\d{3}-\d{2}-\d{4}")


def _may_hold_secret(text: str, low: str) -> bool:
    if not text.isascii():
        return True
    for hint in _HINTS:
        if hint in low:
            return True
    if _DIGIT_PAIR.search(text) is not None and _DIGIT_HINT.search(text) is not None:
        return True
    return _LONG_RUN.search(text) is not None


# Passwords in prose: "my password is hunter2", "pw: hunter2", "the passcode was 1234",
# "the password for the admin account is X", "das Passwort für das Admin-Konto lautet X",
# "le mot de passe du compte admin est X". Words that read as the sentence going on
# ("password is required", "das Passwort ist falsch") are not credentials.
_PASSWORD_NOUN = (r"(?:password|passwd|passphrase|passcode|pwd|pw|passwort|kennwort"
                  r"|mot\s+de\s+passe|contrase[ñn]a|senha)")
_PROSE_PASSWORD = re.compile(
    rf"(?i)(?<![\w-])(?P<head>{_PASSWORD_NOUN}"
    # what it is the password of: "for the admin account", "für das Admin-Konto", "du compte"
    r"(?:\s+(?:for|of|to|on|at|f[üu]r|zum|zur|vom|von|du|de|des|pour|del|para|do|da)"
    r"(?:\s+[^\s.,;:!?\"'<>=]+){1,5}?)?"
    r"(?:\s*[:=]\s*|\s+(?:is|was|would\s+be|will\s+be|ist|lautet|war|est|[ée]tait|sera|es"
    r"|era|[ée])(?!\w)\s*:?\s*))"
    r"(?P<value>[^\s\"'<>]+)"
)
# "my password Hunter2", "mein Passwort X", "mon mot de passe X": no verb, so the value
# must look like a credential (not a plain word: "my password manager" stays).
_OWNED_PASSWORD = re.compile(
    r"(?i)(?<![\w-])(?P<head>(?:my|our|your|his|her|their|new|mein|meine|unser|unsere|dein"
    rf"|deine|neues|mon|ma|notre|votre|ton|nouveau|mi|meu|minha)\s+{_PASSWORD_NOUN}\s+)"
    r"(?P<value>[^\s\"'<>]+)"
)
# Chinese and Japanese write no space around the value: "我的密码是Hunter2，请保密",
# "密码：X", "パスワードはX". The value is the run of ASCII after it.
_CJK_PASSWORD = re.compile(
    r"(?P<head>(?:密码|密碼|口令|パスワード)\s*(?P<sep>[:：=＝]|是|为|為|は)?\s*)"
    r"(?P<value>[!#-&(-;=?-~]+)"
)
_NOT_A_PASSWORD = frozenset({
    "required", "incorrect", "invalid", "wrong", "expired", "missing", "empty", "correct",
    "not", "too", "set", "reset", "changed", "the", "a", "an", "still", "needed", "weak",
    "strong", "valid", "blank", "same", "different", "unknown", "hidden", "redacted",
    # German, French, Spanish, Portuguese
    "falsch", "erforderlich", "abgelaufen", "ungültig", "nicht", "zu", "leer", "korrekt",
    "richtig", "geändert", "gesetzt", "das", "der", "die", "ein", "eine", "noch",
    "requis", "obligatoire", "expiré", "invalide", "pas", "trop", "vide", "erroné", "oublié",
    "changé", "modifié", "nécessaire", "faux", "le", "la", "un", "une",
    "incorrecta", "requerida", "obligatoria", "el", "no", "inválida", "obrigatória",
})
_TRAILING = ".,;:!?)]}"
# A 13-19 digit number, maybe grouped by spaces or dashes, starting as a payment card's
# number does (2-6): the Luhn check then tells a card from an order number.
_CARD = re.compile(r"(?<![\w-])[2-6]\d{3}(?:[ -]?\d){9,15}(?![\w-])")
# The same grouped by dots ("4111.1111.1111.1111"); a decimal ("...4444.00") is not one.
_DOTTED_CARD = re.compile(r"(?<![\w.-])[2-6]\d{3}(?:\.\d{4,6}){2,4}(?![\w-]|\.\d)")
# A US social security number as written: AAA-GG-SSSS, with the numbers never issued
# (area 000, 666, 9xx; group 00; serial 0000) left alone.
_SSN = re.compile(r"(?<![\w-])(?!000|666|9)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\w-])")
# An IBAN, compact or in groups of four: its country's length and check digits decide.
_IBAN = re.compile(r"(?<![\w-])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}(?![\w-])")
_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26,
    "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20,
    "LV": 21, "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30,
    "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22,
    "SA": 24, "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23,
    "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}
# {"name": "X-Api-Key", "value": "..."} written as text (JSON or a Python repr), in either
# order and any case of the labels (`{"Name": "DB_PASSWORD", "Value": ...}`, `"data"`).
_LABEL_NAME = r"(?i:name|key|header|field)"
_LABEL_VALUE = r"(?i:value|val|content|data)"
_LABELLED = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s,}\]\[\"']+"
_NAMED_VALUE = re.compile(
    rf"(?P<head>(?P<q>[\"']){_LABEL_NAME}(?P=q)\s*:\s*(?P<qn>[\"'])"
    rf"(?P<name>[^\"'\n]{{1,100}})(?P=qn)\s*,\s*(?P=q){_LABEL_VALUE}(?P=q)\s*:\s*)"
    rf"(?P<value>{_LABELLED})"
)
_VALUE_THEN_NAME = re.compile(
    rf"(?P<head>(?P<q>[\"']){_LABEL_VALUE}(?P=q)\s*:\s*)(?P<value>{_LABELLED})"
    rf"(?=\s*,\s*(?P=q){_LABEL_NAME}(?P=q)\s*:\s*(?P<qn>[\"'])(?P<name>[^\"'\n]{{1,100}})(?P=qn))"
)
# Characters that hide a word from the passes without changing how it reads: zero-width
# and other format characters (removed), full-width and other compatibility forms (NFKC).
_FORMAT_CHARS = re.compile("[\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                           "\ufeff]")


def luhn_valid(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        n = int(char)
        if index % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _is_card_number(text: str) -> bool:
    digits = text.replace(" ", "").replace("-", "").replace(".", "")
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits)


def _is_word(text: str) -> bool:
    """A word of prose ("manager", "Hunter"), not a credential ("Hunter2", "s3cr3t!")."""
    return text.isalpha() and (len(text) == 1 or text[1:].islower())


def _password_value(match: re.Match, *, must_look_secret: bool = False) -> str:
    value = match["value"]
    if value.startswith(REDACTED):  # already scrubbed by an earlier pass ("password=[redacted]")
        return match[0]
    core = value.rstrip(_TRAILING)
    if not core or core.lower() in _NOT_A_PASSWORD or _is_redacted(core) or (
            core.startswith("/") and not match["head"].rstrip().endswith((":", "="))):
        return match[0]
    if must_look_secret and _is_word(core):
        return match[0]
    return match["head"] + REDACTED + value[len(core):]


def _prose_password(match: re.Match) -> str:
    return _password_value(match)


def _owned_password(match: re.Match) -> str:
    return _password_value(match, must_look_secret=True)


def _cjk_password(match: re.Match) -> str:
    return _password_value(match, must_look_secret=match["sep"] is None)


def _name_space_value(match: re.Match) -> str:
    if not is_secret_key(match["name"]):
        return match[0]
    return _password_value(match, must_look_secret=True)


def _named_value(match: re.Match) -> str:
    if not is_secret_key(match["name"]) or _is_redacted(match["value"]):
        return match[0]
    value = match["value"]
    quote = value[0] if value[0] in "\"'" else ""
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


def _encoded_pair(match: re.Match) -> str:
    name = match["name"]
    if not (is_secret_key(name) or name.lower() in _SECRET_PARAMS) or _is_redacted(
            match["value"]):
        return match[0]
    return match[0][:match.start("value") - match.start()] + REDACTED


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


def _aws_secret(match: re.Match) -> str:
    found = match[0]
    if (any(c.isupper() for c in found) and any(c.islower() for c in found)
            and any(c.isdigit() for c in found)):
        return REDACTED
    return found


def _ibans(text: str) -> str:
    """`text` with every valid IBAN replaced: the match is cut at its country's length (an
    IBAN followed by " EUR" reads on), and a match that is no IBAN is searched again from
    its second character, so an IBAN starting inside it is found on this scrub."""
    out, pos = [], 0
    while (match := _IBAN.search(text, pos)) is not None:
        found = match[0]
        end = _iban_end(found)
        if end is None:
            out.append(text[pos:match.start() + 1])
            pos = match.start() + 1
            continue
        out.append(text[pos:match.start()] + REDACTED)
        pos = match.start() + end
    out.append(text[pos:])
    return "".join(out)


def _iban_end(found: str) -> int | None:
    length = _IBAN_LENGTHS.get(found[:2])
    if length is None:
        return None
    compact = found.replace(" ", "")
    if len(compact) < length:
        return None
    end, seen = 0, 0
    while seen < length:
        seen += found[end] != " "
        end += 1
    if end < len(found) and found[end] != " ":
        return None  # the number runs on past the country's length
    moved = compact[4:length] + compact[:4]
    if int("".join(str(int(c, 36)) for c in moved)) % 97 != 1:
        return None
    return end


def _base64(match: re.Match) -> str:
    found = match[0]
    data = found.replace("-", "+").replace("_", "/").rstrip("=")
    try:
        decoded = base64.b64decode(data + "=" * (-len(data) % 4), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return found
    if not decoded or not all(c.isprintable() or c in "\t\r\n" for c in decoded):
        return found
    return REDACTED if _scrub(decoded, decode=False) != decoded else found


# What each pass needs to find anything, tested once per text with `in` (C speed): a pass
# whose need is absent cannot match and is skipped. REDACTED, the only text a pass writes,
# meets none of these needs, so testing them on the text as it came in is enough.
_DIGIT_PAIR = re.compile(r"\d\d")
_LONG_RUN = re.compile(r"[A-Za-z0-9+/_-]{16}")
_PROSE_WORDS = ("pass", "pw", "kennwort", "contrase", "senha")


def _scrub(text: str, *, decode: bool = True) -> str:
    low = text.lower()
    if not _may_hold_secret(text, low):
        return text
    if "-----begin" in low:
        text = _PEM_BLOCK.sub(REDACTED, text)
    if "://" in text:
        text = _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    if "cookie" in low:
        text = _COOKIE_LINE.sub(lambda m: m[1] + REDACTED, text)
    if "=" in text or ":" in text:
        text = _pairs(text)
    if "%3d" in low:  # the one pass that reads every word start twice
        text = _ENCODED_PAIR.sub(_encoded_pair, text)
    if "bearer" in low or "basic" in low:
        text = _SCHEME.sub(_scheme, text)
    if ('"' in text or "'" in text) and ":" in text:
        text = _NAMED_VALUE.sub(_named_value, text)
        text = _VALUE_THEN_NAME.sub(_named_value, text)
    if any(word in low for word in _PROSE_WORDS):
        text = _PROSE_PASSWORD.sub(_prose_password, text)
        text = _OWNED_PASSWORD.sub(_owned_password, text)
    if not text.isascii():
        text = _CJK_PASSWORD.sub(_cjk_password, text)
    if "_" in text:
        text = _NAME_SPACE_VALUE.sub(_name_space_value, text)
    if "hooks" in low:
        text = _WEBHOOK.sub(lambda m: m["head"] + REDACTED, text)
    if _DIGIT_PAIR.search(text):
        text = _ibans(text)
        text = _SSN.sub(REDACTED, text)
        text = _CARD.sub(lambda m: REDACTED if _is_card_number(m[0]) else m[0], text)
        text = _DOTTED_CARD.sub(lambda m: REDACTED if _is_card_number(m[0]) else m[0], text)
    text = _TOKEN_SHAPES.sub(_token_shape, text)
    if _LONG_RUN.search(text):
        text = _AWS_SECRET.sub(_aws_secret, text)
        if decode:
            text = _BASE64.sub(_base64, text)
    return text


def scrub_text(text: Any) -> Any:
    """`text` with every credential it contains replaced by REDACTED; the same text twice.

    Ordinary text is left alone ("token bucket", "skeleton", a URL without credentials and
    its query). Text that hides a credential behind zero-width or full-width characters
    ("pass\u200bword=", "ｐａｓｓｗｏｒｄ＝") is read once more with them folded (NFKC, format
    characters removed); when that finds a credential, the folded text is what is returned.
    Anything but a string is returned as it is, for the input checks to refuse.
    """
    if not isinstance(text, str):
        return text
    scrubbed = _scrub(text)
    if not scrubbed.isascii():
        folded = _FORMAT_CHARS.sub("", unicodedata.normalize("NFKC", scrubbed))
        if folded != scrubbed and (refolded := _scrub(folded)) != folded:
            return refolded
    return scrubbed


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
# {"name": "X-Api-Key", "value": "..."}, {"Name": "DB_PASSWORD", "Value": ...} (ECS),
# {"name": "password", "data": ...}: the value is secret when the name is a secret's.
_PAIR_NAMES = frozenset({"name", "key", "header", "field"})
_PAIR_VALUES = frozenset({"value", "val", "content", "data"})


def _secret_pair_name(value: Mapping) -> bool:
    return any(isinstance(key, str) and key.lower() in _PAIR_NAMES and isinstance(item, str)
               and is_secret_key(item) for key, item in value.items())


def _redact(value: Any, paths: list[tuple[str, ...]]) -> Any:
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, Mapping):
        named_secret = _secret_pair_name(value)
        out = {}
        for key, item in value.items():
            if is_secret_key(key) or (key,) in paths or (
                    named_secret and str(key).lower() in _PAIR_VALUES):
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

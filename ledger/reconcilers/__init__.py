"""Reconciler kits: the two shapes most APIs have, each a few lines to use.

    from ledger import reconcilers

    # A GET that answers 404 when the effect is absent, 200 with the object when it exists.
    reconcilers.http_lookup("articles.create",
                            url="https://cms.example/api/articles/by-key/{idempotency_key}",
                            external_id="article.id")

    # No look-up by key: list the recent items (bounded) and match them on intent fields.
    reconcilers.list_and_match("mail.send", listing=recent_messages, match=("to", "subject"),
                               external_id="message_id")

    # Any other look-up (a message stream, a mailbox, an SDK): a function of the operation
    # that returns what it found, or None when a complete read shows it absent.
    reconcilers.function_lookup("nats.publish", find=find_in_stream, external_id="seq")

Each call builds a `reconcile.Reconciler` subclass, registers it for the operation name
(pass None to only build it, e.g. as the `search=` of a look-up) and returns it. A kit only
reads and only returns verdicts; the engine decides what they mean, so the in-flight window
holds for kits as for any reconciler: an absence read before `Operation.in_flight_until` is
stored as evidence and the operation stays outcome_unknown until the window has passed.

What a kit records as evidence: the query (the URL it read, credentials scrubbed by
`ledger.canonical.scrub_text`; request headers are never recorded) and what it observed
(the HTTP status and the answer's body, or the listing's size, bound and matches).
"""

from ledger.reconcilers.function import FunctionLookup, function_lookup
from ledger.reconcilers.listing import ListAndMatch, list_and_match
from ledger.reconcilers.lookup import HttpLookup, LookupFailed, http_lookup

__all__ = ["FunctionLookup", "HttpLookup", "ListAndMatch", "LookupFailed", "function_lookup",
           "http_lookup", "list_and_match"]

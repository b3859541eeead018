"""The one place the desk turns a ledger refusal into an HTTP answer.

`errors.NotFound` (no such object among the tenants the user may see) is a 404,
`errors.PermissionDenied` a 403 and an `errors.InvalidInput` no view showed as a message (a
URL's id the input gate refuses) a 400; every other `LedgerError` is the view's to show as
a message. Views fetch through the `ledger.selectors.access_*` helpers and let these two
errors propagate here.
"""

from __future__ import annotations

import functools

from django.core.exceptions import BadRequest, PermissionDenied
from django.http import Http404

from ledger import errors


def ledger_errors(view):
    """Decorate a view: errors.NotFound -> 404, errors.PermissionDenied -> 403,
    errors.InvalidInput -> 400."""

    @functools.wraps(view)
    def wrapped(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except errors.NotFound as exc:
            raise Http404(str(exc)) from exc
        except errors.PermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
        except errors.InvalidInput as exc:
            raise BadRequest(str(exc)) from exc

    return wrapped

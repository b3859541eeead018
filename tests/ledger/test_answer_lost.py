"""An agent's write is tried again only when the database did not answer it
(`transitions.answer_lost`): a lost connection, a server shutting down or not yet accepting
connections, a rollback asking for another try. A statement the database answered with an
error of its own (a lock not available, a statement timeout) is raised at once, not retried
for up to `LOST_ANSWER_RETRY_SECONDS` until it happens to pass."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import OperationalError, connection

from ledger import receipts, transitions
from ledger.models import Operation
from ledger.states import State
from tests.factories import OperationFactory


def _wrapped(error: psycopg.Error) -> OperationalError:
    """The error as Django raises it: its OperationalError, caused by psycopg's."""
    try:
        raise OperationalError(str(error)) from error
    except OperationalError as exc:
        return exc


@pytest.mark.parametrize("error, lost", [
    (psycopg.OperationalError("server closed the connection unexpectedly"), True),
    (psycopg.errors.ConnectionFailure(), True),          # 08006
    (psycopg.errors.AdminShutdown(), True),              # 57P01: a failover
    (psycopg.errors.CannotConnectNow(), True),           # 57P03: starting up
    (psycopg.errors.SerializationFailure(), True),       # 40001: rolled back, try again
    (psycopg.errors.DeadlockDetected(), True),           # 40P01
    (psycopg.errors.QueryCanceled(), False),             # 57014: statement_timeout
    (psycopg.errors.LockNotAvailable(), False),          # 55P03: lock_timeout
    (psycopg.errors.TooManyConnections(), False),        # 53300
])
def test_only_an_unanswered_write_counts_as_a_lost_answer(error, lost):
    assert transitions.answer_lost(_wrapped(error)) is lost


@pytest.mark.django_db(transaction=True)
def test_a_write_refused_for_a_lock_is_raised_at_once_not_retried_until_it_passes():
    op = OperationFactory(state=State.PLANNED)
    settings = connection.settings_dict
    holder = psycopg.connect(dbname=settings["NAME"], user=settings["USER"] or None,
                             host=settings["HOST"] or None, port=settings["PORT"] or None,
                             password=settings["PASSWORD"] or None)
    locked, release = threading.Event(), threading.Event()

    def hold():
        with holder.transaction():
            holder.execute("SELECT 1 FROM ledger_operation WHERE id = %s FOR UPDATE", [op.pk])
            locked.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert locked.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        with pytest.raises(OperationalError) as refused:
            # Retried, it would wait out the holder's transaction and then pass.
            threading.Timer(2.0, release.set).start()
            receipts.mark_submitted(op)
        assert refused.value.__cause__.sqlstate == "55P03"
        assert not release.is_set(), "expected the refusal before the lock was released"
    finally:
        release.set()
        thread.join(10)
        holder.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert Operation.objects.get(pk=op.pk).state == State.PLANNED

"""Settings read from the environment that change how the ledger talks to PostgreSQL."""

import subprocess
import sys

import pytest

from tests.support.processes import PRELUDE, ROOT, child_env

ITERATOR_CURSORS = """
from django.contrib.contenttypes.models import ContentType
from django.db import connection
for _ in ContentType.objects.iterator(chunk_size=1):
    with connection.cursor() as cursor:  # while the iterator is open
        cursor.execute("SELECT count(*) FROM pg_cursors")
        print(cursor.fetchone()[0])
    break
"""


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "open_cursors"), [("1", "1"), ("0", "0")])
def test_server_side_cursors_can_be_turned_off_for_a_transaction_pooler(value, open_cursors):
    # Behind PgBouncer in transaction mode an iterator's named cursor cannot survive
    # between transactions: LEDGER_SERVER_SIDE_CURSORS=0 makes `.iterator()` client-side.
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE.format(root=str(ROOT)) + ITERATOR_CURSORS],
        cwd=ROOT, env={**child_env(), "LEDGER_SERVER_SIDE_CURSORS": value},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == open_cursors

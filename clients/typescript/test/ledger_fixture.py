"""The tests' side of the ledger, run by the venv's Python from the repository's root: make a
database of the tests' own (`manage.py migrate`), agent keys, approval policies and
decisions, through the project's own functions. One command per run; JSON on stdout.

    ledger_fixture.py setup | key NAME TENANTS | revoke NAME | policy PATTERN
                    | approve OP | deny OP REASON | state OP | sweep | drop
"""

import json
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
sys.path.insert(0, os.getcwd())

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402


def admin():
    from django.contrib.auth import get_user_model

    user, _ = get_user_model().objects.get_or_create(
        username="ts-client-admin", defaults={"is_superuser": True, "is_staff": True})
    return user


def create_database(name: str) -> None:
    import psycopg
    from psycopg import sql

    db = settings.DATABASES["default"]
    with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"],
                         password=db["PASSWORD"] or None, dbname="postgres",
                         autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def main(command: str, *args: str) -> object:
    from ledger.models import Operation

    if command == "setup":
        create_database(connection.settings_dict["NAME"])
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        return {"database": connection.settings_dict["NAME"]}
    if command == "key":
        from ledger import agent_keys

        return {"secret": agent_keys.create(args[0], tenants=args[1].split(","),
                                            user=admin())[1]}
    if command == "revoke":
        from ledger import agent_keys

        agent_keys.revoke(args[0], user=admin())
        return {}
    if command == "policy":
        from ledger import approvals

        approvals.set_policy(args[0], user=admin())
        return {}
    if command in ("approve", "deny"):
        from ledger import approvals

        op = Operation.objects.get(operation_id=args[0])
        if command == "approve":
            approvals.approve(op, user=admin(), reason="ok")
        else:
            approvals.deny(op, user=admin(), reason=args[1])
        return {}
    if command == "state":
        op = Operation.objects.get(operation_id=args[0])
        return {"state": op.state, "attempt": op.attempt, "version": op.version}
    raise SystemExit(f"expected a command of {__doc__}, found {command!r}")


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))

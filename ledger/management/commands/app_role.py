"""manage.py app_role --role NAME: run ledger/sql/app_role.sql against the database.

Superseded by `manage.py db_roles` (ledger/db_roles.py): one role per kind of actor (agent,
reconciler, desk), which PostgreSQL tells apart. The single role made here is kept for
databases set up with it; it holds no role of db_roles, so since migration 0030 it cannot
make a person's decision or a reconciler's verdict.
"""

from pathlib import Path

from django.core.management.base import BaseCommand
from django.db import connection, transaction

SCRIPT = Path(__file__).resolve().parents[2] / "sql" / "app_role.sql"


def create_app_role(role: str) -> None:
    """Create (or refresh the grants of) `role`, inside the caller's transaction if any."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('ledger.app_role', %s, true)", [role])
        cursor.execute(SCRIPT.read_text())


class Command(BaseCommand):
    help = ("Create an application role with only the rights the application uses: no "
            "UPDATE/DELETE on the audit tables, no TRUNCATE, no TRIGGER, no DDL (runs "
            "ledger/sql/app_role.sql; rerun after migrations).")

    def add_arguments(self, parser):
        parser.add_argument("--role", default="ledger_app")

    def handle(self, *args, role, **options):
        create_app_role(role)
        self.stdout.write(f"role {role} has only the rights the application uses "
                          "(ledger/sql/app_role.sql)")
        self.stderr.write("app_role is superseded by db_roles: one role per kind of actor "
                          "(ledger_agent, ledger_reconciler, ledger_desk); see "
                          "docs/security.md")

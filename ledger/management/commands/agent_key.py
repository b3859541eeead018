"""manage.py agent_key create NAME --tenant T [--tenant U] | revoke NAME | list"""

import getpass
import socket

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from ledger import agent_keys
from ledger.errors import LedgerError
from ledger.models import AgentKey


class ShellOperator:
    """Whoever runs the command: the database is theirs already, so they hold the admin
    rights; the audit trail records them as `manage.py agent_key (user@host)`."""

    pk = None
    # They own the database: every tenant is theirs (`ledger.access` reads these).
    is_superuser = is_authenticated = is_active = True

    def get_username(self) -> str:
        return f"manage.py agent_key ({getpass.getuser()}@{socket.gethostname()})"

    def has_perm(self, perm: str) -> bool:
        return True


class Command(BaseCommand):
    help = ("Create, revoke or list the keys agents use on the HTTP API and the MCP server. "
            "The secret is printed once, at creation; only its hash is stored.")

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a key and print its secret once")
        create.add_argument("name", help="the agent's name: the actor on every event it causes")
        create.add_argument("--tenant", action="append", required=True, dest="tenants",
                            help="a tenant the key may see and write (repeat for several)")
        create.add_argument("--as", dest="username", default="",
                            help="record this user (who needs ledger.add_agentkey) as creator")
        revoke = sub.add_parser("revoke", help="revoke a key: it authenticates nothing from now")
        revoke.add_argument("name")
        revoke.add_argument("--as", dest="username", default="",
                            help="record this user (who needs ledger.change_agentkey)")
        sub.add_parser("list", help="list the keys (never their secrets)")

    def handle(self, *args, action, **options):
        try:
            if action == "create":
                key, secret = agent_keys.create(
                    options["name"], tenants=options["tenants"], user=self._user(options)
                )
                self.stderr.write(f"created agent key {key.name} for tenants "
                                  f"{', '.join(key.tenants)}; the secret is shown only now:")
                self.stdout.write(secret)
            elif action == "revoke":
                key = agent_keys.revoke(options["name"], user=self._user(options))
                self.stdout.write(f"revoked {key.name} at {key.revoked_at.isoformat()}")
            else:
                for key in AgentKey.objects.order_by("name"):
                    state = f"revoked {key.revoked_at:%Y-%m-%d}" if key.revoked_at else "live"
                    self.stdout.write(f"{key.name}\t{key.prefix}…\t{','.join(key.tenants)}\t"
                                      f"{state}")
        except LedgerError as exc:
            raise CommandError(str(exc)) from None

    def _user(self, options):
        if not options["username"]:
            return ShellOperator()
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"expected a user named {options['username']!r}, found none")
        return user

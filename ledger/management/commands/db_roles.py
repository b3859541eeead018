"""manage.py db_roles: the PostgreSQL roles per kind of actor (ledger/db_roles.py)."""

import argparse

from django.core.management.base import BaseCommand, CommandError

from ledger import db_roles


def _login(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, kinds = text.partition("=")
    if not sep or not name:
        raise CommandError(f"expected --login NAME=KIND[,KIND] (kinds: "
                           f"{', '.join(db_roles.KINDS)}), found {text!r}")
    return name, tuple(k.strip() for k in kinds.split(",") if k.strip())


def _tenants(text: str) -> tuple[str, ...]:
    tenants = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tenants:
        raise CommandError(f"expected --tenants TENANT[,TENANT], found {text!r}")
    return tenants


class _LimitLastLogin(argparse.Action):
    """--tenants limits the --login given just before it."""

    def __call__(self, parser, namespace, values, option_string=None):
        logins = getattr(namespace, "login", None) or []
        if not logins or len(logins[-1]) > 2:
            raise argparse.ArgumentError(
                self, f"expected --tenants right after the --login it limits, found --tenants "
                      f"{','.join(values)} "
                      + ("after another --tenants" if logins else "before any --login"))
        logins[-1] = (*logins[-1], values)


class Command(BaseCommand):
    help = ("Create or update the NOLOGIN group roles ledger_agent, ledger_reconciler and "
            "ledger_desk with the least grants each kind of actor needs (run as the tables' "
            "owner after migrate; idempotent; supersedes app_role). --login NAME=KIND[,KIND] "
            "also makes a login role in those groups, e.g. --login ledger_web=agent,desk; "
            "--login NAME=agent --tenants acme,globex makes an agent's login PostgreSQL "
            "limits to those tenants (row-level security); a login made again without "
            "--tenants is limited to none.")

    def add_arguments(self, parser):
        parser.add_argument("--login", action="append", default=[], type=_login,
                            metavar="NAME=KIND[,KIND]",
                            help="a login role for one process, in the roles of its kinds")
        parser.add_argument("--tenants", type=_tenants, action=_LimitLastLogin,
                            metavar="TENANT[,TENANT]",
                            help="limit the --login just before it, of kind agent alone, to "
                                 "these tenants (PostgreSQL's row-level security)")

    def handle(self, *args, login, **options):
        try:
            for line in db_roles.apply(logins=login):
                self.stdout.write(line)
        except db_roles.RolesRefused as exc:
            raise CommandError(str(exc)) from exc

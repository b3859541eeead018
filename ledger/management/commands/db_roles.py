"""manage.py db_roles: the PostgreSQL roles per kind of actor (ledger/db_roles.py)."""

from django.core.management.base import BaseCommand, CommandError

from ledger import db_roles


def _login(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, kinds = text.partition("=")
    if not sep or not name:
        raise CommandError(f"expected --login NAME=KIND[,KIND] (kinds: "
                           f"{', '.join(db_roles.KINDS)}), found {text!r}")
    return name, tuple(k.strip() for k in kinds.split(",") if k.strip())


class Command(BaseCommand):
    help = ("Create or update the NOLOGIN group roles ledger_agent, ledger_reconciler and "
            "ledger_desk with the least grants each kind of actor needs (run as the tables' "
            "owner after migrate; idempotent; supersedes app_role). --login NAME=KIND[,KIND] "
            "also makes a login role in those groups, e.g. --login ledger_web=agent,desk.")

    def add_arguments(self, parser):
        parser.add_argument("--login", action="append", default=[], type=_login,
                            metavar="NAME=KIND[,KIND]",
                            help="a login role for one process, in the roles of its kinds")

    def handle(self, *args, login, **options):
        try:
            for line in db_roles.apply(logins=login):
                self.stdout.write(line)
        except db_roles.RolesRefused as exc:
            raise CommandError(str(exc)) from exc

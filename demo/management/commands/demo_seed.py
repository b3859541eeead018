"""Create the demo users, operations and runs; prints the users' passwords."""

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connections

from demo.execution import seed_execution
from demo.notifications import seed_notification_channel
from demo.operations import seed_operations
from ledger import access, chain
from ledger.models import Operation, Run

DEMO_USERS = [
    # username, password, group, is_staff
    ("admin", "admin-demo-pass", "admin", True),
    ("reviewer", "reviewer-demo-pass", "reviewer", False),
    ("viewer", "viewer-demo-pass", "viewer", False),
]


class Command(BaseCommand):
    help = ("Create demo users admin, reviewer and viewer (printing their passwords) and "
            "demo operations reconciled against a simulated articles service, and demo runs "
            "with steps, facts (one conflict) and obligations (one overdue).")

    def add_arguments(self, parser):
        parser.add_argument(
            "--reset", action="store_true",
            help="drop the demo's database, create and migrate it again, then seed: the demo "
                 "as it first was (refused with DJANGO_ENV=production)")
        parser.add_argument(
            "--force", action="store_true",
            help="with --reset: drop the database even if it holds operations but no demo run")

    def handle(self, *args, reset=False, force=False, **options):
        if reset:
            self.reset_database(force=force)
        for username, password, group, is_staff in DEMO_USERS:
            user, _ = User.objects.get_or_create(username=username)
            user.set_password(password)
            user.is_staff = is_staff
            user.is_superuser = False
            user.save()
            user.groups.set([Group.objects.get(name=group)])
            for tenant in ("default", "acme"):
                access.grant(user, tenant)
        self.stdout.write("Demo users (all see tenants default and acme):")
        for username, password, group, _ in DEMO_USERS:
            self.stdout.write(f"  {username:<9} password {password:<20} role {group}")
        try:
            seed_operations(self.stdout)
        except OSError as exc:  # the demo's articles port taken: say so, no traceback
            raise CommandError(str(exc)) from exc
        seed_execution(self.stdout)
        seed_notification_channel(self.stdout, user=User.objects.get(username="admin"))
        verify_audit_chain(self.stdout)
        self.stdout.write(banner(settings.LEDGER_DESK_URL))

    def reset_database(self, *, force: bool) -> None:
        if settings.IS_PRODUCTION:
            raise CommandError("expected a development database for --reset, found "
                               "DJANGO_ENV=production: a reset drops the whole database")
        settings_dict = connections["default"].settings_dict
        name = settings_dict["NAME"]
        try:
            foreign = (Operation.objects.exists()
                       and not Run.objects.filter(run_id__startswith="demo-").exists())
        except DatabaseError:  # no tables yet (never migrated): nothing to lose
            foreign = False
        if foreign and not force:
            raise CommandError(
                f'expected database "{name}" to hold the demo (runs demo-*), found operations '
                "and no demo run; --reset --force drops it anyway")
        running = demo_running(name)
        if running:
            raise CommandError(
                f"The demo is running ({running}): stop it first (Ctrl-C where `make demo` "
                "runs), then run `make demo-reset` again.")
        from config.database import create_database, drop_database

        connections.close_all()
        drop_database(settings_dict)
        create_database(settings_dict)
        self.stdout.write(f'Database "{name}" dropped and created again; migrating.')
        call_command("migrate", interactive=False, verbosity=0)


def demo_running(database: str) -> str:
    """What shows the demo running, in words ("" when nothing does): its desk or its
    articles service answering on their ports, or other sessions on its database. A reset
    then would cut the running processes off mid-query (each would print its traceback)."""
    import socket
    from urllib.parse import urlsplit

    from demo.simulated.articles import HOST, demo_articles_port

    signs = []
    desk = urlsplit(settings.LEDGER_DESK_URL)
    for what, host, port in [("the desk", desk.hostname or HOST, desk.port or 80),
                             ("its articles service", HOST, demo_articles_port())]:
        with socket.socket() as probe:
            probe.settimeout(0.5)
            if probe.connect_ex((host, port)) == 0:
                signs.append(f"{what} answers on {host}:{port}")
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND pid <> pg_backend_pid()", [database])
            others = cursor.fetchone()[0]
    except DatabaseError:  # no database yet: nobody is on it
        others = 0
    if others:
        signs.append(f"{others} other session{'s' if others != 1 else ''} on database "
                     f'"{database}"')
    return "; ".join(signs)


def banner(url: str) -> str:
    """What `make demo` ends its set-up with: where to go and who to be."""
    lines = ["", f"Open {url}/ and log in as one of:"]
    for username, password, group, _ in DEMO_USERS:
        lines.append(f"  {username:<9} / {password:<20} ({group})")
    lines += [f"The API is at {url}/api/v1/ (a key: `.venv/bin/python manage.py agent_key "
              "create NAME --tenant default`). Ctrl-C stops every process.", ""]
    return "\n".join(lines)


def verify_audit_chain(stdout) -> None:
    """Check every chain the seed wrote, as `manage.py verify_audit` does, so the audit
    page shows a verified chain (and when) rather than "Never verified"."""
    result = chain.verify(actor="demo_seed")
    links = result.record.links_checked
    found = "intact" if result.is_intact else f"BROKEN: {result.first_break.message}"
    stdout.write(f"Audit chain verified by demo_seed: {links} links checked, {found}.")

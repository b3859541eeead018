"""Create the demo users, operations and runs; prints the users' passwords."""

from django.contrib.auth.models import Group, User
from django.core.management.base import BaseCommand

from demo.execution import seed_execution
from demo.notifications import seed_notification_channel
from demo.operations import seed_operations
from ledger import access, chain

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

    def handle(self, *args, **options):
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
        seed_operations(self.stdout)
        seed_execution(self.stdout)
        seed_notification_channel(self.stdout, user=User.objects.get(username="admin"))
        verify_audit_chain(self.stdout)


def verify_audit_chain(stdout) -> None:
    """Check every chain the seed wrote, as `manage.py verify_audit` does, so the audit
    page shows a verified chain (and when) rather than "Never verified"."""
    result = chain.verify(actor="demo_seed")
    links = result.record.links_checked
    found = "intact" if result.is_intact else f"BROKEN: {result.first_break.message}"
    stdout.write(f"Audit chain verified by demo_seed: {links} links checked, {found}.")

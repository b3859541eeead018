"""manage.py verify_audit: walk every hash chain and name the first broken link."""

import getpass
import socket

from django.core.management.base import BaseCommand, CommandError

from ledger import chain


class Command(BaseCommand):
    help = (
        "Recompute the hash chain of the audit trail of every tenant; exit non-zero and name "
        "the first broken link if any row was altered, removed or inserted out of band."
    )

    def add_arguments(self, parser):
        parser.add_argument("--actor", default="",
                            help="who runs it, for the verification record (default user@host)")

    def handle(self, *args, actor, verbosity, **options):
        actor = actor or f"manage.py verify_audit ({getpass.getuser()}@{socket.gethostname()})"
        result = chain.verify(actor=actor, progress=self.stdout.write if verbosity > 1 else None)
        found = result.first_break
        if found is None:
            self.stdout.write(f"audit trail intact: {result.record.links_checked} links in "
                              f"{len(result.record.heads)} chains")
            return
        where = ", ".join(f"{key} {found.ids[key]}" for key in found.ids)
        raise CommandError(
            f"broken link in {found.chain}/{found.tenant} at seq {found.seq}"
            f"{' (' + where + ')' if where else ''}: {found.message}; expected {found.expected}, "
            f"found {found.found}"
        )

"""manage.py purge [--dry-run] [--batch N] [--batch-target-ms MS] [--pause-ms MS]: apply every
retention policy now."""

import getpass
import socket
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError

from ledger import retention
from ledger.errors import LedgerError

DEFAULT_PAUSE_MS = int(retention.POLITE_PAUSE.total_seconds() * 1000)
DEFAULT_TARGET_MS = int(retention.BATCH_TARGET.total_seconds() * 1000)
MAX_MS = int(retention.MAX_PAUSE.total_seconds() * 1000)


class Command(BaseCommand):
    help = (
        "Delete terminal operations (with their events and evidence) older than their "
        "retention policy allows, then redact the intents of those past redact_after_days; "
        "then superseded facts, episodes, settled obligations and coverage readings (never "
        "a target's latest) past their policies' days. "
        "Small batches, one short transaction each; safe to interrupt and rerun."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true",
                            help="count what would be purged and redacted; change nothing")
        parser.add_argument("--batch", type=int, default=retention.DEFAULT_BATCH,
                            help="operations per transaction at most (default "
                                 f"{retention.DEFAULT_BATCH})")
        parser.add_argument("--batch-target-ms", type=int, default=DEFAULT_TARGET_MS,
                            help="a batch whose transaction takes longer halves the next one, "
                                 "a quick one grows it back up to --batch (default "
                                 f"{DEFAULT_TARGET_MS})")
        parser.add_argument("--pause-ms", type=int, default=DEFAULT_PAUSE_MS,
                            help="milliseconds to wait after each batch, so agents writing "
                                 f"meanwhile keep their latency (default {DEFAULT_PAUSE_MS}; "
                                 "0 purges flat out)")
        parser.add_argument("--actor", default="",
                            help="who runs it, for the PurgeRun record (default user@host)")

    def handle(self, *args, dry_run, batch, batch_target_ms, pause_ms, actor, verbosity,
               **options):
        actor = actor or f"manage.py purge ({getpass.getuser()}@{socket.gethostname()})"
        say = self.stdout.write if verbosity > 0 else None
        if pause_ms < 0:
            raise CommandError(f"expected --pause-ms of 0 or more, found {pause_ms}")
        if batch_target_ms < 1:
            raise CommandError(f"expected --batch-target-ms of 1 or more, found {batch_target_ms}")
        # Checked before a timedelta is built of them: one too large overflows it.
        for option, value in (("--pause-ms", pause_ms), ("--batch-target-ms", batch_target_ms)):
            if value > MAX_MS:
                raise CommandError(f"expected {option} of {MAX_MS} or less, found {value}")
        try:
            result = retention.purge(actor=actor, batch=batch, dry_run=dry_run, progress=say,
                                     pause=timedelta(milliseconds=pause_ms),
                                     batch_target=timedelta(milliseconds=batch_target_ms))
        except LedgerError as exc:
            raise CommandError(str(exc)) from exc
        except KeyboardInterrupt:
            self.stderr.write("interrupted: every finished batch is committed; "
                              "run purge again to continue")
            raise SystemExit(130) from None
        verb = "would purge" if dry_run else "purged"
        self.stdout.write(
            f"{verb} {sum(r.operations_purged for r in result.runs)} operations, "
            f"{'would redact' if dry_run else 'redacted'} "
            f"{sum(r.operations_redacted for r in result.runs)}, "
            f"in {len(result.runs)} policies"
            + (f"; {len(result.batch_seconds)} batches of {min(result.batch_sizes)}-"
               f"{max(result.batch_sizes)}, the longest {max(result.batch_seconds) * 1000:.0f} ms"
               if result.batch_seconds else "")
        )
        rows = sum(r.rows_purged for r in result.state_runs)
        self.stdout.write(f"{verb} {rows} superseded facts, episodes, settled obligations and "
                          f"coverage readings, in {len(result.state_runs)} state policies")

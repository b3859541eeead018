"""`manage.py retries [--tenant T] [--operation NAME]`: the operations waiting in
safe_to_retry, oldest first. The ledger never resends them itself; the agent calls again."""

from django.core.management.base import BaseCommand

from ledger import receipts


class Command(BaseCommand):
    help = "List the operations waiting in safe_to_retry, oldest first."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="default")
        parser.add_argument("--operation", default=None)

    def handle(self, *args, tenant, operation, **options):
        due = receipts.retries_due(tenant=tenant, operation=operation)
        count = 0
        for op in due.iterator():
            count += 1
            self.stdout.write(
                f"{op.operation_id}  {op.operation}  key={op.idempotency_key}  "
                f"attempt={op.attempt}  since={op.state_changed_at:%Y-%m-%dT%H:%M:%SZ}"
            )
        self.stdout.write(f"{count} operation(s) safe to retry in tenant {tenant}")

"""manage.py audit_export: write the signed, self-contained bundle of the audit trail."""

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from ledger import audit_bundle, conf


class Command(BaseCommand):
    help = (
        "Write a self-contained bundle of the audit trail, signed with Ed25519 "
        "(LEDGER_AUDIT_SIGNING_KEY): every link of every chain with the body its hash covers, "
        "the purge anchors, each head, and every signed checkpoint. Refuses (exit non-zero, "
        "naming the break) when the trail does not verify against the checkpoints signed "
        "before; otherwise signs each head as a new checkpoint, kept in the database. "
        "`manage.py verify_audit --bundle FILE --public-key KEY` verifies the bundle "
        "without the database."
    )

    def add_arguments(self, parser):
        parser.add_argument("--output", "-o", metavar="FILE", required=True,
                            help="where to write the bundle (JSON)")
        parser.add_argument("--public-key-out", metavar="FILE", default="",
                            help="also write the signing key's public key (64 hex digits) "
                                 "to FILE, for verify_audit --public-key")
        parser.add_argument("--no-seal", action="store_true",
                            help="do not seal committed events first (they stay out of "
                                 "the bundle until sealed)")

    def handle(self, *args, output, public_key_out, no_seal, **options):
        if not conf.AUDIT_SIGNING_KEY:
            raise CommandError("expected LEDGER_AUDIT_SIGNING_KEY to hold an Ed25519 private "
                               "key (PEM or 64 hex digits), found it empty")
        try:
            key = audit_bundle.load_private_key(conf.AUDIT_SIGNING_KEY)
        except ValueError as exc:
            raise CommandError(f"LEDGER_AUDIT_SIGNING_KEY: {exc}") from None
        try:
            document = audit_bundle.export(key, seal_first=not no_seal)
        except ValueError as exc:
            raise CommandError(f"nothing signed: {exc}") from None
        except DatabaseError as exc:
            raise CommandError(f"expected to read the audit trail, found a database error "
                               f"({type(exc).__name__}): {str(exc).strip()}") from None
        _write(output, json.dumps(document, sort_keys=True) + "\n")
        if public_key_out:
            _write(public_key_out, audit_bundle.public_key_hex(key.public_key()) + "\n")
        links = sum(len(entry["links"]) for entry in document["chains"])
        self.stdout.write(f"bundle written to {output}: {links} links in "
                          f"{len(document['chains'])} chains, {len(document['checkpoints'])} "
                          f"signed checkpoints (key {document['key_id']})")


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"expected {path} to be writable, found "
                           f"{exc.strerror or exc}") from None

"""manage.py verify_audit: walk every hash chain, check the rows it vouches for, name the
first break; export the verified heads or hold the chains to heads exported earlier and to
the signed checkpoints; or (--bundle) verify a signed bundle without the database."""

import getpass
import json
import socket
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from ledger import audit_bundle, chain, conf


class Command(BaseCommand):
    help = (
        "Recompute the hash chain of the audit trail of every tenant and hold the rows it "
        "vouches for to it: every event and human decision (a link altered, removed or "
        "inserted), every chain head against the longest head an earlier intact "
        "verification recorded and against --expect-head (the newest links removed and the "
        "head rewound), every Evidence row against the seal its event carries (rewritten, "
        "removed or inserted), and every operation's state, version, external_id and content "
        "(target, intent, fingerprint, key, retry policy, result; from format 4 every other "
        "column) against its last event "
        "(changed without one), listing every operation row that differs. Exit non-zero "
        "naming the first break if any row was altered, removed or inserted out of band. "
        "Events written before chain format 2 do not cover external_id or evidence payloads "
        "(their evidence is checked by verdict only), nor before format 3 the content. It "
        "first seals what is committed and unsealed (the sealer's work; --no-seal: not), and "
        "reports events still unsealed as the chain's unsealed tail. The chains are also held "
        "to the signed checkpoints (--public-key, or LEDGER_AUDIT_SIGNING_KEY's key); "
        "--bundle verifies an audit_export bundle without the database."
    )

    def add_arguments(self, parser):
        parser.add_argument("--actor", default="",
                            help="who runs it, for the verification record (default user@host)")
        parser.add_argument(
            "--export-head", metavar="FILE", default="",
            help="when the trail is intact, write the verified heads to FILE as JSON "
                 '({"heads": {chain: {tenant: {"seq": n, "hash": h}}}}); keep it where the '
                 "database's owner cannot reach it, and pass it to a later --expect-head",
        )
        parser.add_argument(
            "--expect-head", metavar="FILE", default="",
            help="fail unless every chain still extends the heads in FILE (written by "
                 "--export-head): a head missing, a chain shorter than FILE says, or another "
                 "hash at its seq is a break",
        )
        parser.add_argument(
            "--bundle", metavar="FILE", default="",
            help="verify the signed bundle FILE (manage.py audit_export) instead of the "
                 "database, without connecting to it: its signature, every link from its "
                 "body, every head and every signed checkpoint; needs --public-key",
        )
        parser.add_argument(
            "--public-key", metavar="KEY", action="append", default=[],
            help="an Ed25519 public key (a file holding PEM or 64 hex digits, or the hex "
                 "itself) whose signed checkpoints the chains are held to (repeat for keys "
                 "used before); without it, the key of LEDGER_AUDIT_SIGNING_KEY if set",
        )
        parser.add_argument("--no-seal", action="store_true",
                            help="do not seal committed events first: verify what the "
                                 "sealer linked and report the rest as the unsealed tail")

    def handle(self, *args, actor, verbosity, export_head, expect_head, no_seal, bundle,
               public_key, **options):
        if bundle:
            return self._verify_bundle(bundle, public_key)
        actor = actor or f"manage.py verify_audit ({getpass.getuser()}@{socket.gethostname()})"
        expected = _read_expected(expect_head) if expect_head else None
        keys = [_read_public_key(text) for text in public_key] or _configured_public_key()
        try:
            signed, forged = audit_bundle.stored_checkpoints(keys)
            if forged:
                raise CommandError(f"expected every signed checkpoint to verify with key(s) "
                                   f"{', '.join(audit_bundle.key_id(k) for k in keys)}, found "
                                   f"{len(forged)} forged or altered: {'; '.join(forged)}")
            result = chain.verify(actor=actor, expected_heads=expected,
                                  seal_first=not no_seal, signed_heads=signed,
                                  progress=self.stdout.write if verbosity > 1 else None)
        except DatabaseError as exc:  # named, never a traceback: the trail is not verified
            raise CommandError(
                f"expected to read and record the audit trail, found a database error "
                f"({type(exc).__name__}): {str(exc).strip()}; the trail is NOT verified"
            ) from None
        found = result.first_break
        for row in result.differing:
            self.stderr.write(
                f"operation {row.ids['operation_id']} ({row.tenant}"
                + (f", last event {row.ids['event_id']} at seq {row.seq}"
                   if "event_id" in row.ids else "")
                + f"): {row.message}; expected {row.expected}, found {row.found}")
        differing = sum(head.get("operations_differing", 0) for head in result.record.heads)
        if differing > len(result.differing):
            self.stderr.write(f"... {differing - len(result.differing)} more operation rows "
                              f"differ (at most {chain.MAX_DIFFERING} listed per tenant)")
        for row in result.records_differing:
            self.stderr.write(
                f"record {row.ids['source']} {row.ids['row_id']} ({row.tenant}"
                + (f", last link {row.ids['record_link_id']} at seq {row.seq}"
                   if "record_link_id" in row.ids else "")
                + f"): {row.message}; expected {row.expected}, found {row.found}")
        differing = sum(head.get("records_differing", 0) for head in result.record.heads)
        if differing > len(result.records_differing):
            self.stderr.write(f"... {differing - len(result.records_differing)} more record "
                              f"rows differ (at most {chain.MAX_DIFFERING} listed per tenant)")
        if found is not None:
            where = ", ".join(f"{key} {found.ids[key]}" for key in found.ids)
            raise CommandError(
                f"broken link in {found.chain}/{found.tenant} at seq {found.seq}"
                f"{' (' + where + ')' if where else ''}: {found.message}; expected "
                f"{found.expected}, found {found.found}"
            )
        record = result.record
        operations = sum(head.get("operations_checked", 0) for head in record.heads)
        evidence = sum(head.get("evidence_checked", 0) for head in record.heads)
        records = sum(head.get("records_checked", 0) for head in record.heads)
        self.stdout.write(
            f"audit trail intact: {record.links_checked} links in {len(record.heads)} chains; "
            f"{operations} operations and {evidence} evidence rows match their events"
            + (f"; {records} records match their links" if records else "")
            + (f"; every head extends {expect_head}" if expect_head else "")
        )
        unsealed = sum(head.get("unsealed", 0) for head in record.heads)
        if unsealed:
            self.stdout.write(f"{unsealed} committed event(s) not sealed yet (the unsealed "
                              "tail: run `manage.py seal`)")
        if export_head:
            _write(export_head, chain.export_heads(record))
            self.stdout.write(f"heads written to {export_head}")


    def _verify_bundle(self, path: str, public_keys: list[str]) -> None:
        """The bundle at `path`, without the database (ledger.audit_bundle)."""
        if not public_keys:
            raise CommandError("expected --public-key KEY with --bundle (the public key of "
                               "the signing key the bundle was exported with), found none")
        keys = [_read_public_key(text) for text in public_keys]
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"expected --bundle {path} to be a readable file, found "
                               f"{exc.strerror or exc}") from None
        try:
            document = audit_bundle.read_bundle(text, source=f"--bundle {path}")
            report = audit_bundle.verify_bundle(document, keys)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CommandError(f"expected --bundle {path} to be a well-formed audit bundle, "
                               f"found {type(exc).__name__}: {exc}") from None
        for found in report.breaks[1:]:
            self.stderr.write(f"also broken: {found}")
        if report.breaks:
            raise CommandError(f"broken bundle {path}: {report.breaks[0]}")
        self.stdout.write(
            f"bundle intact: {report.links} links in {report.chains} chains, "
            f"{report.checkpoints} signed checkpoints held (exported {report.exported_at})"
            + (f"; {report.checkpoints_purged} in purged stretches"
               if report.checkpoints_purged else "")
            + (f"; {report.checkpoints_other_keys} signed by other keys, not checked"
               if report.checkpoints_other_keys else ""))


def _read_public_key(text: str):
    path = Path(text)
    try:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"expected --public-key {text} to be readable, found "
                           f"{exc.strerror or exc}") from None
    try:
        return audit_bundle.load_public_key(text)
    except ValueError as exc:
        raise CommandError(f"--public-key: {exc}") from None


def _configured_public_key() -> list:
    if not conf.AUDIT_SIGNING_KEY:
        return []
    try:
        return [audit_bundle.load_private_key(conf.AUDIT_SIGNING_KEY).public_key()]
    except ValueError as exc:
        raise CommandError(f"LEDGER_AUDIT_SIGNING_KEY: {exc}") from None


def _read_expected(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"expected --expect-head {path} to be a readable file, found "
                           f"{exc.strerror or exc}") from None
    try:
        return chain.read_heads(text, source=f"--expect-head {path}")
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _write(path: str, document: dict) -> None:
    try:
        Path(path).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n",
                              encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"expected --export-head {path} to be writable, found "
                           f"{exc.strerror or exc}") from None

from django.db import migrations

# A run's lease is named with its tenant since 0039 (`run:<tenant>:<run_id>`,
# Run.lease_resource): `ledger_run_unfinished` (0038) asks for a live lease under that name.
RUN_UNFINISHED = """
CREATE OR REPLACE FUNCTION ledger_run_unfinished(run_pk bigint) RETURNS boolean
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT run_pk IS NOT NULL AND (
        EXISTS (SELECT 1 FROM ledger_obligation ob
                 WHERE ob.run_id = run_pk AND ob.state = 'open')
        OR EXISTS (SELECT 1 FROM ledger_step s
                    WHERE s.run_id = run_pk AND s.state <> 'committed')
        OR EXISTS (SELECT 1 FROM ledger_operation o
                    WHERE o.run_id = run_pk
                      AND o.state NOT IN ('abandoned', 'rejected', 'succeeded'))
        OR EXISTS (SELECT 1 FROM ledger_run r
                     JOIN ledger_lease l ON l.resource = 'run:'
                          || replace(replace(r.tenant, '%', '%25'), ':', '%3A')
                          || ':' || r.run_id
                    WHERE r.id = run_pk AND l.expires_at > now()))
$$;
"""

RUN_UNFINISHED_0038 = """
CREATE OR REPLACE FUNCTION ledger_run_unfinished(run_pk bigint) RETURNS boolean
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT run_pk IS NOT NULL AND (
        EXISTS (SELECT 1 FROM ledger_obligation ob
                 WHERE ob.run_id = run_pk AND ob.state = 'open')
        OR EXISTS (SELECT 1 FROM ledger_step s
                    WHERE s.run_id = run_pk AND s.state <> 'committed')
        OR EXISTS (SELECT 1 FROM ledger_operation o
                    WHERE o.run_id = run_pk
                      AND o.state NOT IN ('abandoned', 'rejected', 'succeeded'))
        OR EXISTS (SELECT 1 FROM ledger_run r
                     JOIN ledger_lease l ON l.resource = 'run:' || r.run_id
                    WHERE r.id = run_pk AND l.expires_at > now()))
$$;
"""


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0039_run_ids_and_obligation_keys_per_tenant'),
    ]

    operations = [
        migrations.RunSQL(RUN_UNFINISHED, RUN_UNFINISHED_0038),
    ]

-- SPDX-License-Identifier: MIT
-- What one consume record costs PostgreSQL to write, next to the loops' effect row (a pass of
-- run.sh; bench/mq/README.md, "Record row" and "What the MQ target is measured on"). Executor cost only: every INSERT writes
-- 64 rows with INSERT ... SELECT, the rows the loops write (the bench's message ids, group name,
-- fingerprint (one constant value: computing it is not the write), owner and marker), inside one
-- transaction, so no COMMIT or WAL flush is timed.
-- Layouts, rounds interleaved, medians:
--   effect                 the loops' effect table (id bigserial PRIMARY KEY, message_id, body)
--   record                 mq_consume_record as PostgresStore::migrate() created it (LIKE ...
--                          INCLUDING ALL: columns, collations, check, primary key, expiry index)
--   record_no_expiry_index the same without the partial expiry index
--   record_heap            the same row with no index at all
--   record_bytea_fp        the record with its fingerprint as 32 bytes (bytea) instead of 64
--                          hex characters: the saving a schema version 3 would bring
--   minimal                key, one-byte status, 32-byte fingerprint, expiry; primary key only
-- The last three are not idem layouts: they show where the record's cost sits.
--
--   psql -X -q -At -v ON_ERROR_STOP=1 -f record_row.sql   (after a bench run created the table)
SET client_min_messages = warning;
-- Fails clearly when no bench run has created the table yet.
DO $$ BEGIN PERFORM 'public.mq_consume_record'::regclass; END $$;
DROP SCHEMA IF EXISTS idem_bench_row CASCADE;
CREATE SCHEMA idem_bench_row;
CREATE TABLE idem_bench_row.effect (id bigserial PRIMARY KEY, message_id text NOT NULL,
                                    body text NOT NULL);
CREATE TABLE idem_bench_row.record (LIKE public.mq_consume_record INCLUDING ALL);
CREATE TABLE idem_bench_row.record_no_expiry_index (LIKE public.mq_consume_record INCLUDING ALL);
DO $$
DECLARE i regclass;
BEGIN
  FOR i IN SELECT indexrelid::regclass FROM pg_index
           WHERE indrelid = 'idem_bench_row.record_no_expiry_index'::regclass AND NOT indisprimary
  LOOP
    EXECUTE format('DROP INDEX %s', i);
  END LOOP;
END $$;
CREATE TABLE idem_bench_row.record_bytea_fp (LIKE public.mq_consume_record INCLUDING ALL);
ALTER TABLE idem_bench_row.record_bytea_fp ALTER COLUMN fingerprint DROP DEFAULT,
  ALTER COLUMN fingerprint TYPE bytea USING decode(fingerprint, 'hex');
CREATE TABLE idem_bench_row.record_heap
  (LIKE public.mq_consume_record INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
CREATE TABLE idem_bench_row.minimal (
  message_id text COLLATE "C" NOT NULL, consumer_group text COLLATE "C" NOT NULL,
  status "char" NOT NULL, fingerprint bytea NOT NULL, expires_at timestamptz,
  PRIMARY KEY (message_id, consumer_group));

-- Microseconds per row for `statements` INSERTs of 64 rows into `layout`, ids from `base` on.
CREATE FUNCTION idem_bench_row.run(layout text, base bigint, statements int)
RETURNS double precision LANGUAGE plpgsql AS $$
DECLARE
  q text;
  t0 timestamptz;
  keys CONSTANT text := '(SELECT ''order_'' || ($1 + g) || '':paid:v1'' AS k'
                        ' FROM generate_series(0, 63) g) u';
BEGIN
  IF layout = 'effect' THEN
    q := 'INSERT INTO idem_bench_row.effect (message_id, body)'
         ' SELECT k, ''{"order":'' || length(k) || '',"amount":100}'' FROM ' || keys;
  ELSIF layout = 'minimal' THEN
    q := 'INSERT INTO idem_bench_row.minimal'
         ' (message_id, consumer_group, status, fingerprint, expires_at)'
         ' SELECT k, ''dedup_pg_batch-1-0'', ''c'', ''\x6f431f469ffcd84d41e662b6e20dcf8538f5a92a77359e45f1ad58726c71104d''::bytea,'
         ' now() + interval ''1 day'' FROM ' || keys || ' ORDER BY 1';
  ELSE
    -- The columns and values of PostgresStore's batch record INSERT (the fingerprint packed for
    -- record_bytea_fp).
    q := format('INSERT INTO idem_bench_row.%I (message_id, consumer_group, status, fingerprint,'
                ' owner, response_body, lease_until, expires_at)'
                ' SELECT k, ''dedup_pg_batch-1-0'', ''completed'', %s,'
                ' ''apyNiKV50lIjG55'', ''idem-mq:consumed''::bytea, now(), now() + interval ''1 day'''
                ' FROM %s ORDER BY 1', layout,
                CASE WHEN layout = 'record_bytea_fp'
                     THEN '''\x6f431f469ffcd84d41e662b6e20dcf8538f5a92a77359e45f1ad58726c71104d''::bytea'
                     ELSE '''6f431f469ffcd84d41e662b6e20dcf8538f5a92a77359e45f1ad58726c71104d''' END,
                keys);
  END IF;
  t0 := clock_timestamp();
  FOR i IN 0 .. statements - 1 LOOP
    EXECUTE q USING base + i * 64;
  END LOOP;
  RETURN extract(epoch FROM clock_timestamp() - t0) * 1e6 / (statements * 64);
END $$;

-- The layouts in print order, and each round's timing of each.
CREATE TEMP TABLE layouts (ord int, layout text);
INSERT INTO layouts VALUES (1, 'effect'), (2, 'record'), (3, 'record_bytea_fp'),
                           (4, 'record_no_expiry_index'), (5, 'record_heap'), (6, 'minimal');
CREATE TEMP TABLE timing (layout text, us double precision);
DO $$
DECLARE
  l text;
  base bigint := 0;
BEGIN
  FOR round IN 1 .. 9 LOOP
    FOR l IN SELECT layout FROM layouts ORDER BY ord LOOP
      INSERT INTO timing VALUES (l, idem_bench_row.run(l, base, 100));
    END LOOP;
    base := base + 100 * 64;
  END LOOP;
END $$;
CREATE TEMP TABLE medians AS
  SELECT layout, percentile_cont(0.5) WITHIN GROUP (ORDER BY us) AS us FROM timing GROUP BY layout;

SELECT 'record row cost in the executor: INSERT ... SELECT of 64 rows, 9 interleaved rounds of'
       ' 6,400 rows per layout, medians';
SELECT format('  %-24s %s us/row', m.layout, to_char(m.us, '990.00'))
FROM medians m JOIN layouts USING (layout) ORDER BY ord;
SELECT format('ratio mq_record_row_vs_effect_row = %s',
              round(((SELECT us FROM medians WHERE layout = 'effect')
                     / (SELECT us FROM medians WHERE layout = 'record'))::numeric, 2));
DROP SCHEMA idem_bench_row CASCADE;

#!/bin/bash
# What each step of a permit's life costs the primary: WAL records and bytes, WAL flushes and
# commits per request, for submit, grant (one worker), release and the fold of releases, beside a
# plain durable INSERT. Used by docs/scaling.md.
#
# Needs a running PostgreSQL (fsync on) that nothing else uses (pg_stat_wal is cluster-wide), its
# psql and pgbench, and a release build of permitq:
#   PGHOST=/tmp PGPORT=55432 N=4000 docs/measure_costs.sh
# It creates (and drops first) the database `cost`.
set -e
: "${PGHOST:?set PGHOST and PGPORT}" "${PGPORT:?}"
export PGUSER=${PGUSER:-postgres}
P="psql -v ON_ERROR_STOP=1 -qAt"
B=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
PERMITQ=${PERMITQ:-$(dirname "$0")/../target/release/permitq}
N=${N:-4000}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
$P -c "drop database if exists cost" -c "create database cost" >/dev/null
URL="host=$PGHOST port=$PGPORT user=$PGUSER dbname=cost"
$PERMITQ migrate --database-url "$URL" >/dev/null
$PERMITQ semaphore set m 1000000 --database-url "$URL" >/dev/null
snap() { $P cost -F' ' -c "select wal_records, wal_bytes, wal_sync, (select xact_commit from pg_stat_database where datname='cost'), extract(epoch from clock_timestamp()) from pg_stat_wal"; }
diff() { python3 -c "
import sys
a=list(map(float,'$1'.split())); b=list(map(float,'$2'.split())); n=$3
print(f'| $4 | {(b[0]-a[0])/n:.1f} | {(b[1]-a[1])/n:.0f} | {(b[2]-a[2])/n:.3f} | {(b[3]-a[3])/n:.3f} |')"; }
echo '\set n random(1, 2000000000)' > $T/submit.sql
echo "SELECT permitq.submit('m-' || :client_id || '-' || :n, '{\"m\": 1}');" >> $T/submit.sql
echo "SELECT permitq.release((SELECT external_id FROM permitq.permit_request WHERE state = 'acquired' LIMIT 1 FOR UPDATE SKIP LOCKED));" > $T/release.sql
echo "| operation (per request) | WAL records | WAL bytes | WAL flushes | commits |"
echo "|---|---:|---:|---:|---:|"
a=$(snap); $B/pgbench -n -c 8 -j 2 -t $((N/8)) -f $T/submit.sql cost >/dev/null; sleep 1.5; b=$(snap); diff "$a" "$b" $N "submit (8 producers)"
a=$(snap); $PERMITQ worker --database-url "$URL" --id m1 >/dev/null 2>&1 & W=$!
until [ "$($P cost -c "select count(*) from permitq.permit_request where state='new'")" = 0 ]; do sleep 0.02; done; t=$(snap); kill $W; wait $W 2>/dev/null || true; sleep 1.5; b=$(snap); b="$(echo $b | cut -d' ' -f1-4) $(echo $t | cut -d' ' -f5)"; diff "$a" "$b" $N "grant (1 worker, batches of 100)"
a=$(snap); $B/pgbench -n -c 8 -j 2 -t $((N/8)) -f $T/release.sql cost >/dev/null; sleep 1.5; b=$(snap); diff "$a" "$b" $N "release (8 producers, no worker)"
a=$(snap); $PERMITQ worker --database-url "$URL" --id m2 >/dev/null 2>&1 & W=$!
until [ "$($P cost -c "select count(*) from permitq.pending_release")" = 0 ]; do sleep 0.02; done; t=$(snap); kill $W; wait $W 2>/dev/null || true; sleep 1.5; b=$(snap); b="$(echo $b | cut -d' ' -f1-4) $(echo $t | cut -d' ' -f5)"; diff "$a" "$b" $N "fold of the releases (1 worker)"
$P -c "select 1" >/dev/null
a=$(snap); $P cost -c "create table plain (id bigserial primary key, payload text)" >/dev/null; echo "INSERT INTO plain (payload) VALUES ('x');" > $T/ins.sql; a=$(snap); $B/pgbench -n -c 8 -j 2 -t $((N/8)) -f $T/ins.sql cost >/dev/null; sleep 1.5; b=$(snap); diff "$a" "$b" $N "baseline: durable single-row INSERT (8 clients)"

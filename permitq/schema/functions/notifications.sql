-- Waking workers (channel permitq_work) and telling producers outcomes (permitq_events).
--
-- Wake-ups are coalesced: workers record in permitq.worker_wake whether they sleep, and
-- producers NOTIFY only when one does (PostgreSQL serializes the commits of notifying
-- transactions, so a NOTIFY per request would cap the commit rate). The protocol, with the
-- gate permitq.wake_gate (a table lock: only roles that may use the permitq schema can take
-- one, unlike an advisory key, which any login can hold):
--   caller: locks the gate in ROW SHARE mode (held to the end of its transaction, after its
--           commit is visible), then reads worker_wake in a fresh snapshot; NOTIFYs only if a
--           worker sleeps.
--   worker, before sleeping: commits sleeping = true, then locks the gate in EXCLUSIVE mode
--           without waiting and lets it go at once (permitq.wake_gate_free), then runs one more
--           pass. Getting the lock means every caller that could have read sleeping = false has
--           finished, so that pass sees its rows; callers after the commit read true and
--           notify. When the gate is busy the worker does not sleep: it polls (producers are
--           active).
--   a release: notifies only when a worker sleeps and no earlier release already woke it for
--           the same fold (permitq.wake_workers_for_release); the worker then checks after
--           each fold of its own, once the gate is free, that no release is left to fold.
-- Callers in REPEATABLE READ or SERIALIZABLE read an older snapshot, so they always notify.
--
-- Grants never depend on a notification: the NOTIFY queue is one per cluster, and when it is
-- full every commit that notifies fails. permitq.notify sends nothing while the queue is more
-- than rule_notify_queue_limit() full (or the setting permitq.notify_queue_limit) and counts
-- what it skipped in permitq.notify_skipped_seq; producers still see outcomes by polling `status`,
-- and workers poll.

-- pg_notify, unless the queue is filling up: then counts the skip and returns false.
CREATE OR REPLACE FUNCTION permitq.notify(channel text, payload text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    setting text := current_setting('permitq.notify_queue_limit', true);
BEGIN
    IF pg_notification_queue_usage()
       >= coalesce(nullif(setting, '')::float8, permitq.rule_notify_queue_limit()) THEN
        PERFORM nextval('permitq.notify_skipped_seq');
        RETURN false;
    END IF;
    PERFORM pg_notify(channel, payload);
    RETURN true;
END $$;

-- Wakes the workers if any is asleep. Called by every transaction that may make work for them
-- (submit, plain INSERT, cancel; a release calls permitq.wake_workers_for_release, the one
-- definition of the caller's side of the protocol).
CREATE OR REPLACE FUNCTION permitq.wake_workers() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM permitq.wake_workers_for_release(NULL, NULL);
END $$;

-- Wakes the workers if any is asleep (the caller's side of the protocol above); for a release
-- of `semaphores` (the names it gave permits back to, ancestors included) by the requests
-- `released`, only when no earlier release already woke them for it (NULL `semaphores`: not a
-- release, permitq.wake_workers: whenever one sleeps). That is: a request waits on one of
-- these semaphores (the hand-off: at once), semaphores are nested (the room of a parent is
-- every child's: always), or no other release of them waits to be folded (the first since the
-- last fold). Releases
-- beside an idle worker then notify about once per fold, not once each: PostgreSQL serializes
-- the commits of notifying transactions. A release that did not notify is still folded: a
-- worker that found nothing to do checks before it naps, once the wake gate is free (this
-- caller holds it to its commit), whether any release is left to fold, and folds again until
-- none is (permitq::Worker::check_folds: 10 ms later, backing off to the poll interval while
-- producers stay in flight). Under a steady stream of releases that nothing waits for, a
-- release's fold (`used`, its event) may so wait up to a poll interval; grants never wait for
-- it (a claim counts pending releases as room, and every batch folds what it locks). Workers
-- of the release before do not check: they fold such a release at their next pass.
CREATE OR REPLACE FUNCTION permitq.wake_workers_for_release(semaphores text[], released bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM permitq.notify('permitq_work', '');
        RETURN;
    END IF;
    LOCK TABLE permitq.wake_gate IN ROW SHARE MODE;
    IF EXISTS (SELECT 1 FROM permitq.worker_wake WHERE sleeping AND awake_by > now())
       AND (semaphores IS NULL
            OR EXISTS (SELECT 1 FROM permitq.semaphore s
                       JOIN permitq.waiter w ON w.semaphore_id = s.id -- waiter_place_idx
                       WHERE s.name = ANY(semaphores))
            OR EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.parent IS NOT NULL) -- semaphore_parent_idx
            OR NOT EXISTS (SELECT 1 FROM permitq.pending_release p -- pending_release_semaphore_idx
                           WHERE p.semaphore = ANY(semaphores)
                             AND p.request_id <> ALL(released))) THEN
        PERFORM permitq.notify('permitq_work', '');
    END IF;
END $$;

-- Worker, before sleeping: true when no caller that may have seen it awake is still in flight
-- (the gate is free in EXCLUSIVE mode). Run it as a statement of its own: the lock is let go at
-- its commit.
CREATE OR REPLACE FUNCTION permitq.wake_gate_free() RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    LOCK TABLE permitq.wake_gate IN EXCLUSIVE MODE NOWAIT;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END $$;
GRANT EXECUTE ON FUNCTION permitq.wake_gate_free() TO permitq_worker;

-- Tells producers that these requests reached an outcome (acquired, error or released): a JSON
-- array of their ids on permitq_events, nothing else. Any login may LISTEN (PostgreSQL has no
-- grant for it), so a payload carries nothing another role may not read: no external_id, state,
-- token or detail. A producer matches the id its submit returned and reads the outcome with
-- `status`, which follows ownership. At most 300 ids a notification (each at most 20 bytes: a
-- payload stays under 8000). False when a chunk was not sent (see permitq.notify).
CREATE OR REPLACE FUNCTION permitq.notify_events(request_ids bigint[]) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    payload text;
    sent boolean := true;
BEGIN
    FOR payload IN
        SELECT '[' || string_agg(c.id::text, ',' ORDER BY c.id) || ']'
        FROM (SELECT u.id, (row_number() OVER (ORDER BY u.id) - 1) / 300 AS chunk
              FROM (SELECT DISTINCT unnest(request_ids) AS id) u) c
        GROUP BY c.chunk
    LOOP
        sent := permitq.notify('permitq_events', payload) AND sent;
    END LOOP;
    RETURN sent;
END $$;

-- Fairness keys: on a keyed semaphore (permitq.keyed_semaphore, `permitq semaphore set NAME N
-- --fairness-keys`), the line is served across the requests' `fairness_key`s in proportion to
-- their `fairness_weight`s, and in arrival order within a key: a tenant's burst does not make
-- another tenant's request wait behind it.
--
-- Start-time fair queuing, in the units of the place in line (functions/queue_order.sql).
-- When a worker examines a request, under the locks of the semaphores it names, each keyed
-- semaphore s it names gives it a start tag
--     S = max(V(s), F(s, key))      and sets      F(s, key) = S + step × count / weight
-- where V(s) is the semaphore's virtual time (the largest start tag granted there) and F the
-- key's finish tag there (permitq.key_finish), step the aging step (10 s a permit at weight 1, so
-- that the aging bound keeps its form). A key that was idle starts at V: next after what is in
-- service, however long another key's backlog; a key with a backlog is placed further back by
-- one step per permit ahead of it. A request has one place on every line it waits in (the
-- decision ranks a request once), so it gets one offset, the largest S − V over the keyed
-- semaphores it names, and waits at created_at + offset (permitq.placed_at): a fresh key's
-- offset is 0, its arrival, as on any other semaphore. Cost: one key_finish row read and
-- written per request examined on a keyed semaphore, flat in the number of keys and in each
-- key's backlog. Nothing changes on a semaphore that is not keyed.
--
-- Tags order a line; where there is none they are not given. A worker decides a batch naming a
-- keyed semaphore on arrival order first, and places it by key (permitq.place_batch_by_keys)
-- unless placing would move none of its requests (permitq.batch_moves_back_by_key: then every
-- place, bound and head is the same either way) and the decision left nothing waiting
-- (decision::order_mattered: nothing waiting or refused, no request waiting outside the batch,
-- no guarantee in play). Such a batch is granted whole at once and moves no finish tag and not
-- the virtual time: a key is placed back for what it was granted while others waited in line,
-- not for room nobody in line wanted. (Whether a key's grant counts is decided per batch: a
-- batch in which anything waits or moves is placed whole.)

-- Where a request stands in line: its arrival, moved back by the offset a keyed semaphore gave
-- it when it was examined (none before then, nor on semaphores that are not keyed).
CREATE OR REPLACE FUNCTION permitq.placed_at(created_at timestamptz, place_offset interval)
RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT created_at + coalesce(place_offset, interval '0')
$$;
GRANT EXECUTE ON FUNCTION permitq.placed_at(timestamptz, interval)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- A timestamp in microseconds since the epoch (the unit of the place in line), and back.
CREATE OR REPLACE FUNCTION permitq.epoch_us(t timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (extract(epoch FROM t - timestamptz '1970-01-01 00:00:00+00') * 1000000)::bigint
$$;
-- (STABLE, as timestamptz + interval is: so that queries inline it.)
CREATE OR REPLACE FUNCTION permitq.from_epoch_us(us bigint) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT timestamptz '1970-01-01 00:00:00+00' + us * interval '1 microsecond'
$$;

-- What permitq.place_by_keys kept for the rest of the transaction under `name`, an array
-- (empty when it kept nothing: a setting not set in this session reads '').
CREATE OR REPLACE FUNCTION permitq.batch_setting(name text) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting(name, true), ''), '{}')::bigint[]
$$;

-- The start tags and offsets permitq.place_by_keys gave in this transaction: a row per
-- request and keyed semaphore it names; `place_offset` is the request's (the largest over
-- them), the same on each of its rows.
CREATE OR REPLACE FUNCTION permitq.batch_tags()
RETURNS TABLE (request_id bigint, semaphore_id bigint, start_tag timestamptz,
               place_offset interval)
LANGUAGE sql STABLE AS $$
    SELECT t.id, t.semaphore_id, permitq.from_epoch_us(t.start_us),
           t.offset_us * interval '1 microsecond'
    FROM unnest(permitq.batch_setting('permitq.tagged_ids'),
                permitq.batch_setting('permitq.tagged_semaphores'),
                permitq.batch_setting('permitq.tagged_starts_us'),
                permitq.batch_setting('permitq.tagged_offsets_us'))
         AS t(id, semaphore_id, start_us, offset_us)
$$;

-- `places` (in the order of `ids`), each moved back by its request's offset in
-- `tagged_ids`/`offsets_us` (none: unchanged). Joined by hash: permitq.place_by_keys plans
-- its own statements with nested loops only. (PL/pgSQL, so that its plan is kept for the
-- session: a SQL function with a SET clause is planned at every call, 0.3 ms of a batch.)
CREATE OR REPLACE FUNCTION permitq.places_moved_back(ids bigint[], places bigint[],
                                                     tagged_ids bigint[], offsets_us bigint[])
RETURNS bigint[]
LANGUAGE plpgsql IMMUTABLE SET enable_hashjoin = on AS $$
BEGIN
    RETURN (SELECT array_agg(b.place - coalesce(o.offset_us, 0) ORDER BY b.n)
            FROM unnest(ids, places) WITH ORDINALITY AS b(id, place, n)
            LEFT JOIN (SELECT DISTINCT x.id, x.offset_us
                       FROM unnest(tagged_ids, offsets_us) x(id, offset_us)) o ON o.id = b.id);
END $$;

-- Worker step 2, after the semaphore locks (permitq.lock_batch_and_heads): the start tags and
-- offsets of the batch's unexamined requests on the keyed semaphores they name, taken in place
-- order within each key. Writes each key's new finish tag, and keeps the tags and offsets for
-- the rest of the transaction (permitq.batch_tags: next_batch ranks by them, and
-- permitq.apply_decision writes them into the waiter rows and moves the virtual time) rather
-- than in the requests' rows, which are not rewritten for it. Returns `places` (the batch's
-- places in line, in the order of `ids`) with the offsets taken off. The caller holds the row
-- locks of `ids` and the locks of their semaphores; everything it writes goes with the batch's
-- commit or rollback.
-- (Each key's finish tag is looked up by its key, never scanned: flat in the number of keys.)
CREATE OR REPLACE FUNCTION permitq.place_by_keys(ids bigint[], places bigint[])
RETURNS bigint[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET enable_seqscan = off SET enable_mergejoin = off SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    tagged_ids bigint[];
    tagged_semaphores bigint[];
    starts_us bigint[];
    offsets_us bigint[];
BEGIN
    -- (The INSERT in WITH runs to completion, read or not.) Times in microseconds since the
    -- epoch (the place in line's unit); a request's share of its key's turn is
    -- step × count / weight, in whole microseconds.
    -- The batch's own rows first (MATERIALIZED: the checks below run on them alone, never on a
    -- scan of the pending requests a generic plan could choose, where one malformed row would
    -- fail the batch).
    WITH batch AS MATERIALIZED (
        SELECT r.id, r.fairness_key, r.fairness_weight, r.created_at, r.wait_until, b.place,
               CASE WHEN jsonb_typeof(r.permits) = 'object' THEN r.permits ELSE '{}'::jsonb END
                   AS permits
        FROM unnest(ids, places) AS b(id, place)
        JOIN permitq.permit_request r ON r.id = b.id AND r.state = 'new' AND NOT r.examined
    ),
    named AS (
        SELECT r.id, coalesce(r.fairness_key, '') AS fkey, r.place, k.semaphore_id,
               permitq.epoch_us(k.virtual_time) AS v, permitq.epoch_us(r.created_at) AS created_us,
               permitq.rule_aging_step_us()
                   -- Read defensively: a count that is not one counts as 1 (the decision
                   -- fails it).
                   * CASE WHEN jsonb_typeof(e.value) = 'number'
                               AND (e.value #>> '{}')::numeric BETWEEN 1 AND 2147483647
                          THEN (e.value #>> '{}')::numeric::bigint ELSE 1 END
                   / coalesce(r.fairness_weight, 1) AS turn_us
        FROM batch r
        CROSS JOIN LATERAL jsonb_each(r.permits) e
        -- Each semaphore looked up by its name: the generic plan otherwise walked every
        -- semaphore for every request of the batch (flat in the number of semaphores).
        JOIN LATERAL (SELECT x.id FROM permitq.semaphore x WHERE x.name = e.key LIMIT 1) s ON true
        JOIN permitq.keyed_semaphore k ON k.semaphore_id = s.id
        -- A request this batch fails without letting it wait takes no turn: its wait over
        -- already (the claim's `expired`, by this transaction's now()), or a count above the
        -- capacity of a semaphore it names (exceeds_capacity). Read under the batch's locks,
        -- as the decision reads them. (A fail-fast try, wait 0, is placed all the same, for
        -- whether it fits is the decision's, made in its place: refused, it keeps its turn, as
        -- a cancel does, and its error_detail says so.)
        WHERE (r.wait_until IS NULL OR r.wait_until > now())
          AND NOT EXISTS (SELECT 1 FROM jsonb_each(r.permits) c
                          JOIN LATERAL (SELECT x.capacity FROM permitq.semaphore x
                                        WHERE x.name = c.key LIMIT 1) cs ON true
                          WHERE jsonb_typeof(c.value) = 'number'
                            AND (c.value #>> '{}')::numeric > cs.capacity)
    ),
    -- S = max(V, F) + the turns of the key's requests ahead of it in this batch.
    tagged AS (
        SELECT n.id, n.fkey, n.semaphore_id, n.v, n.turn_us, n.created_us,
               greatest(n.v, coalesce(permitq.epoch_us(f.finish), n.v))
                   + (sum(n.turn_us) OVER (PARTITION BY n.semaphore_id, n.fkey
                                           ORDER BY n.place DESC, n.id))::bigint
                   - n.turn_us AS start_us,
               permitq.epoch_us(f.placed_until) AS placed_until_us
        FROM named n
        -- A lookup per request, whatever the statistics say: a plan made while key_finish
        -- was empty scanned every finish tag for every request (a drain over 10,000 keys went
        -- from 3 to 65 ms a batch).
        LEFT JOIN LATERAL (SELECT g.finish, g.placed_until FROM permitq.key_finish g
                           WHERE g.semaphore_id = n.semaphore_id AND g.fairness_key = n.fkey
                           LIMIT 1) f ON true
    ),
    -- Its offset there, S - V, but never placing it ahead of the key's requests placed before
    -- (the virtual time may have passed F while they wait); one offset per request, the
    -- largest over the keyed semaphores it names.
    placed AS (
        SELECT y.id, y.semaphore_id, y.fkey, y.start_us, y.turn_us, y.created_us,
               max(y.row_offset_us) OVER (PARTITION BY y.id) AS offset_us
        FROM (SELECT t.*, greatest(t.start_us - t.v,
                                   coalesce(t.placed_until_us - t.created_us, 0), 0)
                              AS row_offset_us
              FROM tagged t) y
    ),
    finished AS (
        INSERT INTO permitq.key_finish AS f (semaphore_id, fairness_key, finish, placed_until)
        SELECT p.semaphore_id, p.fkey, permitq.from_epoch_us(max(p.start_us + p.turn_us)),
               permitq.from_epoch_us(max(p.created_us + p.offset_us))
        FROM placed p GROUP BY p.semaphore_id, p.fkey
        ON CONFLICT (semaphore_id, fairness_key) DO UPDATE
            SET finish = EXCLUDED.finish,
                placed_until = greatest(f.placed_until, EXCLUDED.placed_until)
    )
    SELECT array_agg(p.id), array_agg(p.semaphore_id), array_agg(p.start_us),
           array_agg(p.offset_us)
    INTO tagged_ids, tagged_semaphores, starts_us, offsets_us
    FROM placed p;
    IF tagged_ids IS NULL THEN
        RETURN places;
    END IF;
    PERFORM set_config('permitq.tagged_ids',
                       (permitq.batch_setting('permitq.tagged_ids') || tagged_ids)::text, true),
            set_config('permitq.tagged_semaphores',
                       (permitq.batch_setting('permitq.tagged_semaphores')
                        || tagged_semaphores)::text, true),
            set_config('permitq.tagged_starts_us',
                       (permitq.batch_setting('permitq.tagged_starts_us') || starts_us)::text,
                       true),
            set_config('permitq.tagged_offsets_us',
                       (permitq.batch_setting('permitq.tagged_offsets_us') || offsets_us)::text,
                       true);
    RETURN permitq.places_moved_back(ids, places, tagged_ids, offsets_us);
END $$;
GRANT EXECUTE ON FUNCTION permitq.place_by_keys(bigint[], bigint[]) TO permitq_worker;

-- Whether permitq.place_by_keys would move any of the batch's unexamined requests `ids` back on
-- the keyed semaphores among `names` (a row per keyed semaphore): a key with two of them there
-- (the second goes a turn after the first), or one whose key's finish tag is past the virtual
-- time or whose key placed a request after its arrival (its offset, S - V or placed_until -
-- created_at, is above 0). When none moves, placing changes no place, no bound and no head: the
-- decision on arrival order is the one placing would give. Read with the batch's semaphore
-- locks held. (Looked up by key, as place_by_keys does: flat in the number of keys.)
CREATE OR REPLACE FUNCTION permitq.batch_moves_back_by_key(ids bigint[], names text[])
RETURNS TABLE (semaphore_id bigint, name text, moves_back boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET enable_seqscan = off SET enable_mergejoin = off SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    WITH keyed AS (
        SELECT s.id, s.name, k.virtual_time
        FROM unnest(batch_moves_back_by_key.names) AS n(name)
        JOIN LATERAL (SELECT x.id, x.name FROM permitq.semaphore x WHERE x.name = n.name
                      LIMIT 1) s ON true
        JOIN permitq.keyed_semaphore k ON k.semaphore_id = s.id
    ),
    named AS (
        SELECT kd.id AS semaphore_id, coalesce(r.fairness_key, '') AS fkey, r.created_at,
               kd.virtual_time
        FROM unnest(batch_moves_back_by_key.ids) AS b(id)
        JOIN permitq.permit_request r ON r.id = b.id AND r.state = 'new' AND NOT r.examined
        JOIN keyed kd ON jsonb_typeof(r.permits) = 'object' AND r.permits ? kd.name
    ),
    moved AS (
        SELECT n.semaphore_id FROM named n
        GROUP BY n.semaphore_id, n.fkey HAVING count(*) > 1
        UNION
        SELECT n.semaphore_id FROM named n
        JOIN LATERAL (SELECT f.finish, f.placed_until FROM permitq.key_finish f
                      WHERE f.semaphore_id = n.semaphore_id AND f.fairness_key = n.fkey
                      LIMIT 1) f ON true
        WHERE f.finish > n.virtual_time OR f.placed_until > n.created_at
    )
    SELECT kd.id, kd.name, EXISTS (SELECT 1 FROM moved m WHERE m.semaphore_id = kd.id)
    FROM keyed kd;
END $$;
GRANT EXECUTE ON FUNCTION permitq.batch_moves_back_by_key(bigint[], text[]) TO permitq_worker;

-- For requests `ids` that stop waiting without a grant (cancelled or timed out): the keyed
-- semaphores where each had taken a turn (its waiter rows' start tags, or this transaction's
-- tags for one placed in the batch that ends it), as `{"turn_kept_on": [names]}` to add to its
-- error_detail; no row for a request that took none. Its turn stays taken there until the line
-- passes it, so its key's next request is placed behind it. Read before the waiter rows go. One
-- statement for the whole set (the tags are read once).
CREATE OR REPLACE FUNCTION permitq.turns_kept(ids bigint[])
RETURNS TABLE (request_id bigint, detail jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT t.request_id, jsonb_build_object('turn_kept_on', jsonb_agg(s.name ORDER BY s.name))
    FROM (SELECT w.request_id, w.semaphore_id FROM permitq.waiter w
          WHERE w.request_id = ANY(ids) AND w.start_tag IS NOT NULL
          UNION
          SELECT b.request_id, b.semaphore_id FROM permitq.batch_tags() b
          WHERE b.request_id = ANY(ids)) t
    -- Still keyed: turning keys off forgets the turns.
    JOIN permitq.keyed_semaphore k ON k.semaphore_id = t.semaphore_id
    JOIN permitq.semaphore s ON s.id = t.semaphore_id
    GROUP BY t.request_id
$$;

-- After a batch's grants (permitq.apply_decision): each keyed semaphore's virtual time moves to
-- the largest start tag granted there (from the grants' waiter rows, or, for a request granted
-- in the batch that examined it, from this transaction's tags). Never backwards.
CREATE OR REPLACE FUNCTION permitq.advance_virtual_time(granted bigint[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    UPDATE permitq.keyed_semaphore k SET virtual_time = t.tag
    FROM (SELECT x.semaphore_id, max(x.tag) AS tag
          FROM (SELECT w.semaphore_id, w.start_tag AS tag
                FROM permitq.waiter w
                WHERE w.request_id = ANY(granted) AND w.start_tag IS NOT NULL
                UNION ALL
                SELECT b.semaphore_id, b.start_tag
                FROM permitq.batch_tags() b
                WHERE b.request_id = ANY(granted)) x
          GROUP BY x.semaphore_id) t
    WHERE k.semaphore_id = t.semaphore_id AND t.tag > k.virtual_time;
END $$;
GRANT EXECUTE ON FUNCTION permitq.advance_virtual_time(bigint[]) TO permitq_worker;

-- The operator's switch: serve semaphore `name`'s line by fairness key (`keyed`), or by
-- priority and arrival alone again. Turning it on starts its virtual time now; turning it off
-- forgets its keys' finish tags (the requests already placed keep their places). A fair
-- semaphore only: a greedy one grants whatever fits, in no order. On a template it is set on the
-- template and every instance it has, and instances made later follow it
-- (permitq.make_instances); each instance is a line of its own, with its own keys' turns. An
-- instance may still be switched on its own. Returns whether it is keyed now.
CREATE OR REPLACE FUNCTION permitq.set_fairness_keys(name text, keyed boolean)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    s permitq.semaphore;
BEGIN
    -- Lock order: the nesting gate before any semaphore row, as set_capacity, set_adaptive and
    -- the adaptive cadence take them (a client may call this before set_capacity).
    LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE;
    SELECT * INTO s FROM permitq.semaphore x WHERE x.name = set_fairness_keys.name FOR UPDATE;
    -- Off on a semaphore not made yet: nothing to turn off (a client turns keys off before it
    -- makes a semaphore greedy, in the same transaction).
    IF NOT FOUND AND NOT keyed THEN
        RETURN false;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no semaphore named %', set_fairness_keys.name
            USING ERRCODE = '22023',
                  HINT = format('create it first: `permitq semaphore set %s CAPACITY --fairness-keys`',
                                permitq.shell_word(set_fairness_keys.name));
    END IF;
    IF keyed AND NOT s.fair THEN
        RAISE EXCEPTION 'invalid fairness keys: % is greedy (any request that fits goes first), so it serves no line',
            s.name USING ERRCODE = '22023',
            HINT = format('make it fair too: `permitq semaphore set %s %s --fair --fairness-keys`',
                          permitq.shell_word(s.name), s.capacity);
    END IF;
    -- A template's instances follow it (locked in id order after it, the lock order of
    -- semaphore rows, as set_capacity takes them).
    IF s.is_template THEN
        PERFORM 1 FROM permitq.semaphore x WHERE x.template = s.name ORDER BY x.id FOR UPDATE;
    END IF;
    -- Each semaphore switched is audited ({"fairness_keys": keyed} in its capacity history).
    IF keyed THEN
        -- (A template's instance made greedy by hand is left as it is: greedy serves no line.)
        PERFORM permitq.audit_setting(x, jsonb_build_object('fairness_keys', true))
        FROM permitq.semaphore x
        WHERE (x.id = s.id OR (x.template = s.name AND x.fair))
          AND NOT EXISTS (SELECT 1 FROM permitq.keyed_semaphore k WHERE k.semaphore_id = x.id);
        INSERT INTO permitq.keyed_semaphore (semaphore_id)
        SELECT x.id FROM permitq.semaphore x WHERE x.id = s.id OR (x.template = s.name AND x.fair)
        ON CONFLICT (semaphore_id) DO NOTHING;
    ELSE
        PERFORM permitq.audit_setting(x, jsonb_build_object('fairness_keys', false))
        FROM permitq.semaphore x
        JOIN permitq.keyed_semaphore k ON k.semaphore_id = x.id
        WHERE x.id = s.id OR x.template = s.name;
        DELETE FROM permitq.keyed_semaphore k
        USING permitq.semaphore x WHERE k.semaphore_id = x.id AND (x.id = s.id OR x.template = s.name);
        DELETE FROM permitq.key_finish f
        USING permitq.semaphore x WHERE f.semaphore_id = x.id AND (x.id = s.id OR x.template = s.name);
    END IF;
    RETURN keyed;
END $$;
GRANT EXECUTE ON FUNCTION permitq.set_fairness_keys(text, boolean) TO permitq_admin;

-- A fairness key as the answers show it: as it is when that cannot be mistaken (printable ASCII
-- words apart by single spaces, whatever the database's locale), else quoted as a JSON string
-- (keys are compared exactly: `acme `, with a trailing space, is not `acme`).
CREATE OR REPLACE FUNCTION permitq.shown_key(fairness_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN fairness_key ~ '^[!-~]+( [!-~]+)*$' THEN fairness_key
                ELSE to_json(fairness_key)::text END
$$;
GRANT EXECUTE ON FUNCTION permitq.shown_key(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Each fairness key's share of keyed semaphore `name` now: its weight (the largest its waiting
-- requests asked, whose turns the shares are about; when none waits, its holders'; 1 when it
-- has neither), the requests of it waiting in line and the permits they ask, and the permits it
-- holds; and how far back a request of it arriving now would be placed (`placed_back`: the turns
-- its key has taken that the line has not passed, S - V or the key's latest place: NULL when
-- none, as place_by_keys gives it). A key with such turns outstanding but nothing waiting or
-- held is listed too, after the others, when the whole line was read: its next request still
-- goes back. Most waiting first, then most held, at most 20 keys ('' is the requests with no
-- key). What `semaphore show`, the status page and the API show. A producer sees its own
-- requests' keys alone, and no `placed_back` (it counts every login's turns under the key).
-- Cost: the line's first 10000 waiters in line order, its holders, a finish tag looked up per key
-- shown, and at most 1000 more of the semaphore's finish tags read by its key (index lookups
-- only, as place_by_keys plans them: flat in the other semaphores' lines and keys).
CREATE OR REPLACE FUNCTION permitq.key_shares(name text)
RETURNS TABLE (fairness_key text, weight integer, waiting bigint, waiting_permits bigint,
               held bigint, placed_back interval)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
    WITH s AS (SELECT s.id, k.virtual_time FROM permitq.semaphore s
               JOIN permitq.keyed_semaphore k ON k.semaphore_id = s.id
               WHERE s.name = key_shares.name),
    -- The first 10000 of its line, in line order (waiter_place_idx), each request by its id.
    line AS (
        SELECT coalesce(r.fairness_key, '') AS fkey, coalesce(r.fairness_weight, 1) AS w,
               w.count, r.submitted_by
        FROM s
        CROSS JOIN LATERAL (SELECT wt.request_id, wt.count FROM permitq.waiter wt
                            WHERE wt.semaphore_id = s.id
                            ORDER BY permitq.rule_place_in_line(wt.priority, wt.created_at) DESC,
                                     wt.request_id
                            LIMIT 10000) w
        CROSS JOIN LATERAL (SELECT x.fairness_key, x.fairness_weight, x.submitted_by
                            FROM permitq.permit_request x WHERE x.id = w.request_id) r
    ),
    holding AS (
        SELECT coalesce(r.fairness_key, '') AS fkey, coalesce(r.fairness_weight, 1) AS w,
               (coalesce(r.charged, r.permits) ->> key_shares.name)::bigint AS count,
               r.submitted_by
        FROM permitq.permit_request r
        WHERE EXISTS (SELECT 1 FROM s) AND r.state = 'acquired'
          AND coalesce(r.charged, r.permits) ? key_shares.name
    ),
    shares AS (
        SELECT x.fkey, coalesce(max(x.w) FILTER (WHERE x.waits), max(x.w))::integer AS w,
               count(*) FILTER (WHERE x.waits) AS waiting,
               coalesce(sum(x.count) FILTER (WHERE x.waits), 0)::bigint AS waiting_count,
               coalesce(sum(x.count) FILTER (WHERE NOT x.waits), 0)::bigint AS held_count
        FROM (SELECT l.fkey, l.w, l.count::bigint, true AS waits, l.submitted_by FROM line l
              UNION ALL
              SELECT h.fkey, h.w, h.count, false, h.submitted_by FROM holding h) x
        WHERE permitq.may_read(x.submitted_by)
        GROUP BY x.fkey
    ),
    -- Keys with turns outstanding and nothing waiting or held: read only when the whole line
    -- was (a key of the line past its first 10000 would read as waiting for nothing), and
    -- every login's turns, so only to a session that reads every request. At most 1000 of the
    -- semaphore's finish tags, by its key (retention deletes those the line has passed, so these
    -- are mostly outstanding; past them, such a key is not listed).
    turns_only AS (
        SELECT g.fairness_key AS fkey,
               nullif(greatest(g.finish - s.virtual_time, g.placed_until - now(), interval '0'),
                      interval '0') AS back
        FROM s CROSS JOIN LATERAL (SELECT f.fairness_key, f.finish, f.placed_until
                                   FROM permitq.key_finish f
                                   WHERE f.semaphore_id = s.id
                                   ORDER BY f.semaphore_id, f.fairness_key
                                   LIMIT 1000) g
        WHERE permitq.reads_every_request()
          AND (SELECT count(*) FROM line) < 10000
          AND NOT EXISTS (SELECT 1 FROM shares sh WHERE sh.fkey = g.fairness_key)
    )
    -- How far back each key shown would place its next request: its finish tag looked up by
    -- key (every login's turns under the key: only to a session that reads every request).
    SELECT k.fkey, k.w, k.waiting, k.waiting_count, k.held_count,
           CASE WHEN k.turns_only THEN k.back
                ELSE (SELECT nullif(greatest(f.finish - s.virtual_time, f.placed_until - now(),
                                             interval '0'), interval '0')
                      FROM s JOIN permitq.key_finish f
                        ON f.semaphore_id = s.id AND f.fairness_key = k.fkey
                      WHERE permitq.reads_every_request()) END
    FROM (SELECT sh.fkey, sh.w, sh.waiting, sh.waiting_count, sh.held_count,
                 NULL::interval AS back, false AS turns_only
          FROM shares sh
          UNION ALL
          SELECT t.fkey, 1, 0, 0, 0, t.back, true FROM turns_only t WHERE t.back IS NOT NULL
          ORDER BY 3 DESC, 5 DESC, 1
          LIMIT 20) k
    ORDER BY k.waiting DESC, k.held_count DESC, k.fkey
$$;
GRANT EXECUTE ON FUNCTION permitq.key_shares(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

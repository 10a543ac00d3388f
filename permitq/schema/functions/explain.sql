-- permitq.explain: why a request waits. For a waiting request, one row per semaphore it names,
-- and one per ancestor of those (nested limits, functions/nesting.sql; `via` the semaphore it
-- names below it, and `kept` the room the parent keeps for other children's guarantees):
-- the count it needs, the room free there now and the shortfall; its place in that semaphore's
-- line and the permits the requests ahead of it need; what holds it back there (`reason`); the
-- holders, soonest to end first (at most 10, with how long they have held, their lease's end
-- and the seconds until then); and an estimate of the wait. For a request that no longer waits, one row with its
-- outcome and no semaphore. No row for an unknown request, nor for another role's unless the
-- session reads every request (as `status`).
--
-- The estimate is labelled as one: the permits to be freed (the shortfall plus what the requests
-- ahead need) over the rate at which this semaphore's permits were released lately (among the
-- last 2000 requests settled anywhere, between the first of them and the last,
-- `last_released_at`), counted from the last release; for a spent rate window, when it opens;
-- NULL with fewer than two releases there, or once none came for three mean gaps between them
-- (releases stopped: the same for every waiter on the semaphore). Cost: per semaphore named, the waiters ahead (counted from waiter_line_idx,
-- and the unexamined requests placed ahead, at most 10000 each), the held requests, and those
-- 2000 settled rows: never the whole backlog.
-- The recorded waiters of semaphore $1 placed ahead of request $3 at place $2 (at most 10000):
-- within a level the line runs by created_at, so those placed ahead are a prefix of
-- waiter_line_idx: created before the moment that would place them level with the request
-- (and at that moment, a lower id). Explain's place in line and a borrower's arithmetic.
CREATE OR REPLACE FUNCTION permitq.waiters_ahead(bigint, bigint, bigint)
RETURNS TABLE (request_id bigint, count integer)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT w.request_id, w.count FROM permitq.waiter_levels($1) lv(priority)
    CROSS JOIN LATERAL (
        SELECT timestamptz '1970-01-01 00:00:00+00'
               + (lv.priority::bigint * permitq.rule_aging_step_us() - $2)
                 * interval '1 microsecond' AS level_with) b
    JOIN permitq.waiter w
      ON w.semaphore_id = $1 AND w.priority = lv.priority
     AND w.created_at <= b.level_with
     AND (w.created_at < b.level_with OR w.request_id < $3)
     AND w.request_id <> $3
    LIMIT 10000
$$;

-- A waiting request's priority in words, from its priority and its place in line
-- (functions/queue_order.sql): as submitted, and what aging (one per AGING_STEP waited) has
-- raised it to once it has, `5` or `5, aged to 13`: an older request of lower priority stands
-- ahead of a later one of higher priority, and this says why.
CREATE OR REPLACE FUNCTION permitq.priority_words(priority integer, place bigint) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN a.aged > priority THEN format('%s, aged to %s', priority, a.aged)
                ELSE priority::text END
    FROM (SELECT floor((place + (extract(epoch FROM now() - timestamptz '1970-01-01 00:00:00+00')
                                 * 1000000)::bigint)::numeric
                       / permitq.rule_aging_step_us())::bigint AS aged) a
$$;

-- Whether a request arriving from now on goes ahead of one that stands at `place` (at the same
-- priority), in words: `goes ahead of it if it arrives in the next 19s, behind it after`.
CREATE OR REPLACE FUNCTION permitq.goes_ahead_until(place timestamptz) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN place > now()
                THEN format('goes ahead of it if it arrives in the next %s, behind it after',
                            permitq.human_duration(place - now()))
                ELSE 'goes behind it, whenever it arrives from now on' END
$$;

-- What a fairness key did to waiting request `r`'s place on semaphore `s`, in words (NULL where
-- `s` is not keyed, functions/fairness.sql), a sentence each: its key and weight, and how far
-- back its key's turns placed it (`placed_later`, its waiter rows' offset: one place on every
-- line, the largest its keyed semaphores gave); which of its key's requests took their turns on
-- `s` before it and still wait there, and their turns (the latest 3 named; only those this login
-- may read: a key is not a login's own), the rest of the turns being of its key's requests
-- granted or ended; its net place with its priority; and until when a request of a key with no
-- turns outstanding still goes ahead of it. Cost: at most 10000 of the line's waiters.
CREATE OR REPLACE FUNCTION permitq.fairness_answer(r permitq.permit_request, s permitq.semaphore,
                                                   placed_later interval)
RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    step interval := permitq.rule_aging_step_us() * interval '1 microsecond';
    placed timestamptz := permitq.placed_at(r.created_at, placed_later);
    -- Its offset, none as 0.
    offset_by interval := coalesce(placed_later, interval '0');
    key_words text;
    ahead text;
    ahead_count bigint;
    ahead_turns interval;
    -- Its start tag on `s` (its waiter row's).
    my_tag timestamptz;
    -- Where its offset may have come from besides `s`.
    elsewhere text;
    ended text := 'its key''s requests already granted or ended (held, released, cancelled, timed out or failed)';
    later text;
    -- Where its priority puts it, net of its offset ('' at priority 0).
    net text := '';
    -- The keyed semaphores it names: its offset is the largest of theirs.
    keyed_names text[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.keyed_semaphore k WHERE k.semaphore_id = s.id) THEN
        RETURN NULL;
    END IF;
    key_words := format('%s, weight %s',
        CASE WHEN r.fairness_key IS NULL
             THEN 'no fairness key (the requests without one share one key, `(no key)` in `semaphore show`)'
             ELSE 'fairness key ' || permitq.shown_key(r.fairness_key) END,
        coalesce(r.fairness_weight, 1));
    -- A keyed parent it does not name: its line takes it at the place its own semaphores gave
    -- it (functions/fairness.sql orders by key only the requests that name a keyed semaphore).
    IF NOT (jsonb_typeof(r.permits) = 'object' AND r.permits ? s.name) THEN
        RETURN key_words || format(': this line takes it through the semaphore it names below %s, at the place the semaphores it names gave it (%s): keys order here only the requests that name %s itself.',
                                   s.name,
                                   CASE WHEN NOT r.examined THEN 'not placed yet'
                                        WHEN offset_by = interval '0' THEN 'at its arrival'
                                        ELSE permitq.human_duration(placed_later) || ' after its arrival' END,
                                   s.name);
    END IF;
    IF NOT r.examined THEN
        RETURN key_words || format(': not placed yet; a worker places it when it first examines it: at its arrival, or later by the turns of its key''s earlier requests that the line has not passed (%s × count ÷ weight each).',
                                   permitq.human_duration(step));
    END IF;
    -- A request of a key with no turns outstanding goes ahead of it when it arrives before its
    -- place, less one turn per priority step it has above this one's (functions/queue_order.sql):
    -- said for its own priority, and for priority 0 when that is another.
    later := format(' A request of a key with no turns outstanding at priority %s %s',
                    r.priority, permitq.goes_ahead_until(placed))
        || CASE WHEN r.priority <> 0
                THEN format('; at priority 0, %s', permitq.goes_ahead_until(placed - r.priority * step))
                ELSE '' END
        || format(' (a priority one step higher counts as one turn, %s, earlier).',
                  permitq.human_duration(step));
    -- The net of its priority: each step one turn earlier.
    IF r.priority <> 0 THEN
        net := format(' With its priority %s (%s turn%s, %s, %s) it stands %s.',
                      r.priority, abs(r.priority), CASE WHEN abs(r.priority) = 1 THEN '' ELSE 's' END,
                      permitq.human_duration(abs(r.priority) * step),
                      CASE WHEN r.priority > 0 THEN 'earlier' ELSE 'later' END,
                      CASE WHEN offset_by - r.priority * step >= interval '0'
                           THEN permitq.human_duration(offset_by - r.priority * step) || ' after its arrival'
                           ELSE permitq.human_duration(r.priority * step - offset_by) || ' before its arrival' END);
    END IF;
    IF offset_by = interval '0' THEN
        RETURN key_words || ': placed at its arrival: when a worker examined it, no turn of its key was ahead of the line (requests granted while nobody waited take no turn).'
               || net || later;
    END IF;
    SELECT array_agg(x.name ORDER BY x.name) INTO keyed_names
    FROM permitq.semaphore x JOIN permitq.keyed_semaphore k ON k.semaphore_id = x.id
    WHERE r.permits ? x.name;
    -- Its key's requests that took their turns here before its own and still wait (anywhere in
    -- this line: a lower priority may stand behind it), that this login may read: the latest
    -- 3 named, in the order they took their turns (the earlier ones counted before them), and
    -- their turns (step × count ÷ weight each). Told by the start tags of the waiter rows (its
    -- own here: my_tag); without one, by submission order.
    SELECT w.start_tag INTO my_tag FROM permitq.waiter w
    WHERE w.request_id = r.id AND w.semaphore_id = s.id;
    SELECT CASE WHEN count(*) > 3 THEN format('%s earlier, then ', count(*) - 3) ELSE '' END
               || string_agg(x.external_id, ', ' ORDER BY x.id) FILTER (WHERE x.n <= 3),
           count(*),
           sum(step * x.count / x.weight)
    INTO ahead, ahead_count, ahead_turns
    FROM (SELECT pr.id, pr.external_id, w.count, coalesce(pr.fairness_weight, 1) AS weight,
                 row_number() OVER (ORDER BY pr.id DESC) AS n
          FROM (SELECT wt.request_id, wt.count, wt.start_tag FROM permitq.waiter wt
                WHERE wt.semaphore_id = s.id AND wt.request_id <> r.id
                LIMIT 10000) w
          JOIN permitq.permit_request pr ON pr.id = w.request_id
          WHERE pr.fairness_key IS NOT DISTINCT FROM r.fairness_key
            AND CASE WHEN my_tag IS NOT NULL AND w.start_tag IS NOT NULL
                     THEN w.start_tag < my_tag ELSE pr.id < r.id END
            AND permitq.may_read(pr.submitted_by)) x;
    elsewhere := CASE WHEN cardinality(keyed_names) > 1
                      THEN format(', or turns on %s', array_to_string(array_remove(keyed_names, s.name), ', '))
                      ELSE '' END;
    RETURN key_words || format(': placed %s after its arrival, by its key''s turns that the line had not passed when a worker examined it %s (a turn is %s × count ÷ weight; the line''s turn is the start of the latest turn granted there).',
                               permitq.human_duration(placed_later),
                               CASE WHEN cardinality(keyed_names) > 1
                                    THEN format('on one of %s (its one place on every line is the furthest back of theirs)',
                                                array_to_string(keyed_names, ', '))
                                    ELSE 'here' END,
                               permitq.human_duration(step))
           || CASE WHEN ahead_count > 0
                   THEN format(' Its key''s requests that took their turns before it and still wait here: %s (their turns: %s)%s; %s count too, until the line passes their turns.',
                               ahead, permitq.human_duration(ahead_turns),
                               CASE WHEN permitq.reads_every_request() THEN ''
                                    ELSE ', of yours: other logins'' requests with its key are not listed' END,
                               ended)
                   WHEN permitq.reads_every_request()
                   THEN format(' None of its key''s requests that took their turns before it still waits here: the turns are of %s%s, which count until the line passes them.',
                               ended, elsewhere)
                   ELSE format(' None of yours with its key that took their turns before it still waits here (other logins'' requests are not listed); %s%s count too, until the line passes their turns.',
                               ended, elsewhere)
                   END
           || net || later;
END $$;

CREATE OR REPLACE FUNCTION permitq.explain(external_id text)
RETURNS TABLE (request text, state text, outcome text, semaphore text, needs integer,
               capacity integer, free integer, shortfall integer, "position" bigint,
               permits_ahead bigint, reason text, holders jsonb, estimated_wait interval,
               via text, kept integer, last_released_at timestamptz, fairness text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_variable
DECLARE
    r permitq.permit_request;
    s permitq.semaphore;
    named record;
    place bigint;
    -- How much later than its arrival a keyed semaphore placed it (functions/fairness.sql).
    placed_later interval;
    head record;
    ahead_count bigint;
    opens_at timestamptz;
    released_permits bigint;
    released_since timestamptz;
    released_count bigint;
    -- Of the permits ahead on a fair parent, what goes beyond their children's unused
    -- guarantees (what is within them is in `kept` already).
    beyond_ahead bigint;
    waiters_ahead_permits bigint;
    rate float8;
    child permitq.semaphore;
    within_guarantee boolean;
    kept_for text;
    lent_to text;
    every_name text[];
    short_names text[];
    -- Capacity less what is held: below zero after a capacity lowered under what is held,
    -- when more than the request's count must be released first.
    room bigint;
    -- What it takes beyond the unused guarantee of its child below a parent (NULL: within it,
    -- or no parent), and the child's name (an instance not made yet: its template's guarantee).
    borrows bigint;
    child_name text;
    -- The child's guarantee not held now: a request of it for up to this needs only room.
    own_unused bigint;
    -- Another child of this parent has a guarantee.
    others_guaranteed boolean;
    -- The earliest grant of those holding here: releases before it were of other holders.
    first_held_at timestamptz;
    -- On a parent: the first in line of a fair semaphore it names below that keeps its count
    -- free here too, and the reason that gives (see below).
    child_head_id bigint;
    child_head_count integer;
    child_head_priority text;
    child_head_at text;
    child_head_shown text;
    child_head_reason text;
BEGIN
    SELECT * INTO r FROM permitq.permit_request pr
    WHERE pr.external_id = explain.external_id
      AND permitq.may_read(pr.submitted_by);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    request := r.external_id;
    state := r.state::text;
    IF r.state NOT IN ('new', 'in_progress') THEN
        -- In words, as `permitq status` says it: `error exceeds_capacity`, `released (by its
        -- holder)`, `acquired`.
        outcome := concat_ws(' ', r.state, r.error_code,
                             CASE r.release_reason
                                 WHEN 'released' THEN '(by its holder)'
                                 WHEN 'expired' THEN '(expired: its lease ran out)'
                                 WHEN 'revoked' THEN coalesce('(revoked by ' || (r.error_detail ->> 'revoked_by') || ')',
                                                              '(revoked: by an admin, or its owner was reported gone)')
                                 WHEN 'stale' THEN '(stale: held past the workers'' --max-hold)'
                                 ELSE '(' || r.release_reason || ')' END,
                             -- How long it held and since when, as `release` says it.
                             CASE WHEN r.released_at IS NOT NULL AND r.acquired_at IS NOT NULL
                                  THEN format('after %s held, %s ago',
                                              permitq.human_duration(r.released_at - r.acquired_at),
                                              permitq.human_duration(now() - r.released_at)) END,
                             -- What an error hit, as `status` has it (`permitq explain` says it
                             -- in words): {"semaphore": "gpu", "count": 5, "capacity": 4}.
                             -- A template named itself, in words (its detail cannot say it:
                             -- `similar` is empty, as a template is never granted).
                             CASE WHEN r.error_code = 'unknown_semaphore'
                                       AND right(r.error_detail ->> 'semaphore', 1) = '*'
                                       AND NOT r.error_detail ? 'named'
                                  THEN format('(%s is a template, which is never granted itself: name an instance of it (%sNAME, made at its first grant), under a new external_id)',
                                              r.error_detail ->> 'semaphore',
                                              left(r.error_detail ->> 'semaphore', -1)) END,
                             CASE WHEN r.state = 'error' AND r.error_detail IS NOT NULL
                                       AND r.error_detail <> '{}'
                                  THEN r.error_detail::text END);
        RETURN NEXT;
        RETURN;
    END IF;
    -- Where it waits: once examined, its waiter rows' place (a keyed semaphore may have placed
    -- it later than its arrival: functions/fairness.sql).
    SELECT max(w.place_offset) INTO placed_later FROM permitq.waiter w WHERE w.request_id = r.id;
    place := permitq.rule_place_in_line(r.priority, permitq.placed_at(r.created_at, placed_later));
    SELECT array_agg(t.name ORDER BY t.depth, t.name) INTO every_name FROM permitq.taken_by(r.permits) t;
    -- Those short of room (or missing): what a row that fits names as holding it back, before
    -- every other row (a fair line's head or a kept reserve may hold it back where room is not
    -- short).
    SELECT array_agg(t.name ORDER BY t.depth, t.name) INTO short_names
    FROM permitq.taken_by(r.permits) t
    LEFT JOIN permitq.semaphore x ON x.name = t.name
    WHERE x.id IS NULL OR permitq.free_room(x) < t.count;
    -- What it takes from each semaphore: what it names there, or below it.
    FOR named IN SELECT * FROM permitq.taken_by(r.permits) LOOP
        semaphore := named.name;
        needs := named.count;
        via := named.via;
        capacity := NULL; free := NULL; shortfall := NULL; "position" := NULL; kept := NULL;
        permits_ahead := NULL; holders := '[]'; estimated_wait := NULL; opens_at := NULL;
        last_released_at := NULL; fairness := NULL;
        within_guarantee := false;
        SELECT * INTO s FROM permitq.semaphore sem WHERE sem.name = named.name;
        IF NOT FOUND THEN
            reason := CASE
                WHEN (permitq.template_for(named.name)).name IS NOT NULL THEN
                    format('not made yet: a worker makes it from template %s at the grant',
                           (permitq.template_for(named.name)).name)
                ELSE permitq.unknown_name_answer(named.name) END;
            RETURN NEXT;
            CONTINUE;
        END IF;
        capacity := s.capacity;
        room := permitq.free_room(s);
        free := least(greatest(room, 0), 2147483647);
        -- When the window has room for this request's count (not for one permit).
        opens_at := permitq.window_room_at(s, needs);
        shortfall := least(greatest(needs::int8 - room, 0), 2147483647);
        -- A parent: within the guarantee of the child below it (`via`'s chain), room is all it
        -- needs; beyond it, or named itself, the room kept for the other active children's
        -- unused guarantees is not its.
        child := NULL;
        borrows := NULL;
        child_name := NULL;
        own_unused := 0;
        IF named.depth > 0 THEN
            SELECT x.ancestor INTO child_name FROM permitq.ancestors(ARRAY[named.via]) x
            WHERE x.depth = named.depth - 1;
            SELECT * INTO child FROM permitq.semaphore c WHERE c.name = child_name;
            IF NOT FOUND THEN
                -- An instance not made yet: its template's guarantee, nothing held yet.
                child := permitq.template_for(child_name);
                child.used := 0;
            END IF;
            -- What it takes beyond the child's unused guarantee (none: within it, room is all
            -- it needs).
            own_unused := greatest(coalesce(child.guarantee, 0) - coalesce(child.used, 0), 0);
            borrows := needs - own_unused;
            within_guarantee := borrows <= 0;
            IF within_guarantee THEN
                borrows := NULL;
            END IF;
        END IF;
        -- Another child with a guarantee: its requests within it need only room here (read
        -- only for a borrower, the one the reason below speaks of it for).
        others_guaranteed := false;
        IF borrows > 0 THEN
            others_guaranteed := EXISTS (SELECT 1 FROM permitq.semaphore c
                                         WHERE c.parent = s.name AND c.guarantee > 0
                                           AND c.name IS DISTINCT FROM child_name);
        END IF;
        SELECT nullif(coalesce(sum(greatest(c.guarantee - c.used, 0)), 0), 0),
               string_agg(format('%s (%s of its %s unused)', c.name, greatest(c.guarantee - c.used, 0),
                                 c.guarantee), ', ' ORDER BY c.name)
                   FILTER (WHERE c.guarantee > c.used)
        INTO kept, kept_for
        FROM permitq.semaphore c
        WHERE c.parent = s.name AND c.guarantee > 0 AND c.name IS DISTINCT FROM child.name
          -- Every other child: not one it takes through (permitq::decision's reserve_after).
          AND c.name NOT IN (SELECT a.ancestor FROM jsonb_object_keys(r.permits) k
                             CROSS JOIN LATERAL permitq.ancestors(ARRAY[k]) a)
          AND NOT c.is_template
          AND (c.used > 0 OR EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = c.id
                                     AND w.count <= c.guarantee - c.used));
        -- Within a guarantee and short, the parent's room is held by children beyond their own
        -- guarantees (and by requests naming the parent itself): named, as what must end.
        lent_to := NULL;
        IF within_guarantee THEN
            SELECT string_agg(x.what, ', ' ORDER BY x.what) INTO lent_to
            FROM (SELECT format('%s (%s held, guarantee %s)', c.name, c.used, c.guarantee) AS what
                  FROM permitq.semaphore c
                  WHERE c.parent = s.name AND NOT c.is_template AND c.used > c.guarantee
                  UNION ALL
                  SELECT format('requests naming %s itself (%s held)', s.name, d.held)
                  FROM (SELECT s.used - coalesce(sum(c.used), 0) AS held FROM permitq.semaphore c
                        WHERE c.parent = s.name AND NOT c.is_template) d
                  WHERE d.held > 0) x;
        END IF;
        -- A borrower's room is what is free beyond the room kept: the rest must be released
        -- first (releases below the kept children raise what is kept as much as what is free).
        IF NOT within_guarantee AND kept > 0 THEN
            shortfall := least(greatest(needs::int8 + kept - room, 0), 2147483647);
        END IF;

        -- The line: the first of every priority level (a loose index scan), the best placed of
        -- them is the head; then those placed ahead of this request, level by level.
        SELECT w.request_id, w.count, w.priority, pr.external_id,
               permitq.rule_place_in_line(w.priority, w.created_at) AS place
        INTO head
        FROM permitq.waiter_levels(s.id) lv(priority)
        CROSS JOIN LATERAL (
            SELECT wt.request_id, wt.count, wt.priority, wt.created_at FROM permitq.waiter wt
            WHERE wt.semaphore_id = s.id AND wt.priority = lv.priority
            ORDER BY wt.semaphore_id, wt.priority DESC, wt.created_at, wt.request_id
            LIMIT 1) w
        JOIN permitq.permit_request pr ON pr.id = w.request_id
        ORDER BY 5 DESC, 1
        LIMIT 1;
        -- The decision's rule (permitq::decision, `heads_below_kept`): on a parent, the first in
        -- line of each fair semaphore it names below, if ahead of it and within every guarantee
        -- on its chain (one that borrows takes its turn in the parents' lines), keeps its count
        -- free here too. The one that needs the most is named.
        child_head_id := NULL;
        child_head_reason := NULL;
        IF named.depth > 0 AND r.examined THEN
            SELECT w.request_id, w.count,
                   permitq.priority_words(w.priority, permitq.rule_place_in_line(w.priority, w.created_at)),
                   vs.name,
                   CASE WHEN permitq.may_read(pr.submitted_by) THEN pr.external_id
                        ELSE '(another login''s)' END
            INTO child_head_id, child_head_count, child_head_priority, child_head_at, child_head_shown
            FROM jsonb_object_keys(r.permits) k
            JOIN permitq.ancestors(ARRAY[k]) up ON up.ancestor = s.name AND up.depth > 0
            JOIN permitq.semaphore vs ON vs.name = k AND vs.fair
            CROSS JOIN LATERAL (
                SELECT wt.request_id, wt.count, wt.priority, wt.created_at FROM permitq.waiter wt
                WHERE wt.semaphore_id = vs.id AND wt.request_id <> r.id
                ORDER BY wt.semaphore_id, permitq.rule_place_in_line(wt.priority, wt.created_at) DESC,
                         wt.request_id -- waiter_place_idx
                LIMIT 1) w
            JOIN permitq.permit_request pr ON pr.id = w.request_id
            WHERE (permitq.rule_place_in_line(w.priority, w.created_at) > place
                   OR (permitq.rule_place_in_line(w.priority, w.created_at) = place AND w.request_id < r.id))
              AND NOT EXISTS (SELECT 1 FROM permitq.ancestors(ARRAY[k]) a
                              JOIN permitq.semaphore c ON c.name = a.ancestor
                              WHERE c.parent IS NOT NULL AND w.count > greatest(c.guarantee - c.used, 0))
            ORDER BY w.count DESC
            LIMIT 1;
            IF child_head_id IS NOT NULL AND room - needs < child_head_count THEN
                child_head_reason := format('parent: request %s is first in line at %s (priority %s, needs %s) and waits for room here too; a later request there goes after it, so %s more %s must be released here first (%s for it, then %s for this one; %s free now)%s',
                    child_head_shown, child_head_at, child_head_priority, child_head_count,
                    child_head_count + needs - room,
                    CASE WHEN child_head_count + needs - room = 1 THEN 'permit' ELSE 'permits' END,
                    child_head_count, needs, free,
                    -- Granted, the head uses the guarantee this request is within now: then it
                    -- borrows, and the room kept for the other children counts too.
                    CASE WHEN within_guarantee AND child.name = child_head_at AND coalesce(kept, 0) > 0
                              AND child_head_count + needs > child.guarantee - child.used
                         THEN format('; once it is granted, this request goes beyond the guarantee of %s and borrows, so the %s kept for the other children''s guarantees must be free as well',
                                     child.name, kept)
                         ELSE '' END);
            END IF;
        END IF;
        IF r.examined THEN
            SELECT count(*), coalesce(sum(a.count), 0) INTO ahead_count, permits_ahead
            FROM permitq.waiters_ahead(s.id, place, r.id) a;
            -- And the requests not examined yet that are placed ahead (the workers count them as
            -- waiting too): a prefix of permit_request_unexamined_place_idx, at most 10000.
            SELECT ahead_count + count(*), permits_ahead + coalesce(sum((u.permits ->> s.name)::int), 0)
            INTO ahead_count, permits_ahead
            FROM (SELECT pr.permits FROM permitq.permit_request pr
                  WHERE pr.state = 'new' AND NOT pr.examined
                    AND permitq.rule_place_in_line(pr.priority, pr.created_at) >= place
                    AND pr.id <> r.id AND pr.permits ? s.name
                  ORDER BY permitq.rule_place_in_line(pr.priority, pr.created_at) DESC
                  LIMIT 10000) u;
            "position" := ahead_count + 1;
        END IF;
        -- A borrower on a fair parent: the requests ahead of it take theirs first, but what they
        -- take within their own child's unused guarantee is counted in `kept` already.
        beyond_ahead := NULL;
        IF r.examined AND NOT within_guarantee AND kept > 0 AND s.fair AND permits_ahead > 0 THEN
            SELECT coalesce(sum(greatest(x.ahead - x.unused, 0)), 0), coalesce(sum(x.ahead), 0)
            INTO beyond_ahead, waiters_ahead_permits
            FROM (SELECT ch.name, sum(a.count) AS ahead,
                         coalesce(max(greatest(ch.guarantee - ch.used, 0)), 0) AS unused
                  FROM permitq.waiters_ahead(s.id, place, r.id) a
                  JOIN permitq.permit_request pr ON pr.id = a.request_id
                  -- The child of this parent its request comes through (none: it names the
                  -- parent itself, all beyond).
                  LEFT JOIN LATERAL (
                      SELECT c.name, c.guarantee, c.used
                      FROM jsonb_object_keys(pr.permits) k
                      JOIN permitq.ancestors(ARRAY[k]) up ON up.ancestor = s.name
                      JOIN permitq.ancestors(ARRAY[k]) down ON down.depth = up.depth - 1
                      JOIN permitq.semaphore c ON c.name = down.ancestor
                      LIMIT 1) ch ON true
                  GROUP BY ch.name) x;
            -- Those not examined yet name the parent itself: beyond.
            beyond_ahead := beyond_ahead + greatest(permits_ahead - waiters_ahead_permits, 0);
        END IF;

        reason := CASE
            -- Not examined yet, on a spent window: the window is what it waits for either way
            -- (and the estimate below is the window's), so it is named first.
            WHEN NOT r.examined AND opens_at IS NOT NULL AND shortfall > 0 THEN
                format('rate limit: its window has room for %s of the %s it needs (%s / %s granted per %s); room opens in %s (not examined by a worker yet: a running worker does within a second or so, and then this shows its place in line)',
                       free, needs, s.capacity - free, s.capacity, permitq.human_duration(s.per),
                       permitq.human_duration(greatest(opens_at - now(), interval '0')))
            WHEN NOT r.examined THEN
                'not examined by a worker yet: a running worker does within a second or so, and then this shows its place in line (a worker that died counts as running until its last sign of life runs out, up to 8s; then this says that nothing is granting)'
            -- Within a guarantee, behind the first in line of a fair semaphore it names below,
            -- which needs this room too: it goes after it.
            WHEN within_guarantee AND child_head_reason IS NOT NULL THEN child_head_reason
            WHEN within_guarantee THEN
                CASE WHEN shortfall > 0
                     THEN format('parent: within the guarantee of %s (%s), waits for %s more %s to be released%s; granted as they end: by a release, at a lease''s end, past a worker''s --max-hold, or by an admin''s `permitq revoke ID`%s',
                                 child.name, child.guarantee, shortfall,
                                 CASE WHEN shortfall = 1 THEN 'permit' ELSE 'permits' END,
                                 CASE WHEN lent_to IS NOT NULL
                                      THEN format(' (its room is lent beyond their guarantees to: %s)', lent_to)
                                      ELSE '' END,
                                 -- A greedy child keeps no line: a later, smaller request of it
                                 -- may use the guarantee first, and this one then borrows.
                                 CASE WHEN child.fair IS FALSE
                                      THEN format('. %s is greedy: a later, smaller request of it may take part of the guarantee first, and this one then borrows (`permitq semaphore set %s %s --fair` keeps its line)',
                                                  child.name, permitq.shell_word(child.name), child.capacity)
                                      ELSE '' END)
                     ELSE format('parent: it fits within the guarantee of %s (%s)', child.name, child.guarantee) END
            WHEN kept > 0 AND shortfall > 0 THEN
                -- The arithmetic spelled out: the free room beyond what is kept is the borrower's;
                -- on a fair parent, the requests ahead in its line take theirs first.
                format('parent: %s; %s of its room %s kept for the guarantees of its other active children: %s. %s needed + %s kept%s %s = %s more %s must be released here first',
                       CASE WHEN child.name IS NULL THEN 'a request naming the parent itself borrows'
                            ELSE format('%s borrows beyond its guarantee (%s)', child.name, child.guarantee) END,
                       kept, CASE WHEN kept = 1 THEN 'is' ELSE 'are' END, kept_for, needs, kept,
                       CASE WHEN beyond_ahead > 0
                            THEN format(' + %s for the %s ahead in its line%s', beyond_ahead,
                                        CASE WHEN ahead_count = 1 THEN 'request'
                                             ELSE format('%s requests', ahead_count) END,
                                        CASE WHEN beyond_ahead < permits_ahead
                                             THEN format(' (of their %s, what goes beyond their guarantees)', permits_ahead)
                                             ELSE '' END)
                            ELSE '' END,
                       -- Held beyond a capacity lowered under it counts as well.
                       CASE WHEN room < 0 THEN format('+ %s held beyond its capacity', -room)
                            ELSE format('- %s free', free) END,
                       shortfall + coalesce(beyond_ahead, 0),
                       CASE WHEN shortfall + coalesce(beyond_ahead, 0) = 1
                            THEN 'permit' ELSE 'permits' END)
            WHEN opens_at IS NOT NULL AND shortfall > 0 AND free > 0 THEN
                format('rate limit: its window has room for %s of the %s it needs (%s / %s granted per %s); room for %s opens in %s, as earlier grants leave the window',
                       free, needs, s.capacity - free, s.capacity, permitq.human_duration(s.per),
                       needs, permitq.human_duration(greatest(opens_at - now(), interval '0')))
            WHEN opens_at IS NOT NULL AND shortfall > 0 THEN
                format('rate limit: its window is spent (%s / %s granted per %s); opens in %s',
                       s.capacity - free, s.capacity, permitq.human_duration(s.per),
                       permitq.human_duration(greatest(opens_at - now(), interval '0')))
            -- Fair, behind the head, and short or taking the head's room: the head is what it
            -- waits for. Where it fits and leaves the head its room, fairness holds nothing
            -- back: the branches below say so.
            WHEN s.fair AND head.request_id IS NOT NULL AND head.request_id <> r.id
                 AND (shortfall > 0 OR free::int8 - needs < head.count) THEN
                format('fair: request %s is first in line (priority %s, needs %s)%s',
                       -- Named to a producer only when it is its own (reads follow ownership).
                       CASE WHEN EXISTS (SELECT 1 FROM permitq.permit_request x
                                         WHERE x.id = head.request_id
                                           AND permitq.may_read(x.submitted_by))
                            THEN head.external_id ELSE '(another login''s)' END,
                       permitq.priority_words(head.priority, head.place), head.count,
                       -- Short: those ahead go first (the head among them), so their
                       -- permits are released for too (the head's alone until examined).
                       -- What is held beyond a lowered capacity goes before anyone fits:
                       -- it is in the first part.
                       CASE WHEN shortfall > 0
                            THEN format(', and %s more %s must be released (%s for %s first, then %s for it)',
                                        shortfall + coalesce(permits_ahead, head.count),
                                        CASE WHEN shortfall + coalesce(permits_ahead, head.count) = 1 THEN 'permit' ELSE 'permits' END,
                                        coalesce(permits_ahead, head.count) + greatest(-room, 0),
                                        CASE WHEN permits_ahead IS NULL OR ahead_count <= 1 THEN 'the head'
                                             ELSE format('the %s requests ahead', ahead_count) END,
                                        shortfall - greatest(-room, 0))
                            -- Even with every permit free it would not leave the head its
                            -- room: it goes after the head, whatever is released.
                            WHEN s.capacity::int8 - needs < head.count
                            THEN format(': it cannot go before it (the head needs %s of the capacity %s, so with this request''s %s held it could never fit), so it goes after it: once the head is granted (%s) and %s %s free again',
                                        head.count, s.capacity, needs,
                                        CASE WHEN head.count > free
                                             THEN format('%s more %s released', head.count - free,
                                                         CASE WHEN head.count - free = 1 THEN 'permit' ELSE 'permits' END)
                                             ELSE 'it fits now' END,
                                        needs, CASE WHEN needs = 1 THEN 'permit is' ELSE 'permits are' END)
                            ELSE format(': what is free would not leave it its room, so %s more %s must be released first',
                                        head.count - (free::int8 - needs),
                                        CASE WHEN head.count - (free::int8 - needs) = 1 THEN 'permit' ELSE 'permits' END) END)
            -- A borrower that the branches above found room for: that head holds it back.
            WHEN child_head_reason IS NOT NULL AND shortfall = 0 THEN child_head_reason
            WHEN shortfall > 0 THEN
                format('waits for %s more %s to be released%s%s', shortfall, CASE WHEN shortfall = 1 THEN 'permit' ELSE 'permits' END,
                       CASE WHEN s.fair THEN ' (first in line)' ELSE ' (greedy)' END,
                       -- A borrower here: a request within its child's guarantee needs only
                       -- room, so it may take the free room before this one, whatever the line:
                       -- one of another child, or a smaller one of its own child while that
                       -- child's guarantee is not all used.
                       CASE WHEN borrows > 0 AND (others_guaranteed OR own_unused > 0)
                            THEN format('; it borrows %s beyond %s: %s',
                                        borrows,
                                        CASE WHEN coalesce(child.guarantee, 0) > 0
                                             THEN format('the guarantee of %s (%s)', child_name, child.guarantee)
                                             WHEN child_name IS NOT NULL THEN format('%s, which has no guarantee', child_name)
                                             ELSE 'any guarantee (it names the parent itself)' END,
                                        CASE WHEN NOT others_guaranteed
                                             THEN format('a later request of %s for at most %s, within its guarantee, needs only room, so it may take the free room first',
                                                         child_name, own_unused)
                                             WHEN own_unused > 0
                                             THEN format('a request within its child''s guarantee needs only room, so it may take the free room first: one of another child, or one of %s itself for at most %s',
                                                         child_name, own_unused)
                                             ELSE 'a request of another child within its own guarantee needs only room, so it may take the free room first' END)
                            ELSE '' END)
            WHEN cardinality(every_name) = 1 THEN 'it fits: a worker grants it at its next pass (within a second or so; if not, no worker runs: one that died counts as running for up to 8s, then this says that nothing is granting)'
            ELSE format('it fits here; what holds it back is on its other rows: %s',
                        array_to_string(coalesce(nullif(array_remove(short_names, named.name), '{}'),
                                                 array_remove(every_name, named.name)), ', '))
        END;

        -- A capacity lowered below what is held: what is held here beyond it must go too.
        IF room < 0 AND s.per IS NULL THEN
            reason := reason || format(' (%s held here, more than its capacity %s: it was lowered below what is held, which revokes nothing)',
                                       s.capacity - room, s.capacity);
        END IF;
        -- Served by fairness key (functions/fairness.sql): where its key's turns placed it.
        fairness := permitq.fairness_answer(r, s, placed_later);
        -- Past its wait, it is not granted: the next pass ends it.
        IF r.wait_until <= now() THEN
            reason := format('its wait ran out %s ago: the next worker pass ends it as timeout, not granted (before that: %s)',
                             permitq.human_duration(now() - r.wait_until), reason);
        END IF;

        -- The holders it waits on, where it is short of room (elsewhere none are what it needs):
        -- read from the held requests, a scan of them per semaphore read, so only there.
        first_held_at := NULL;
        IF shortfall > 0 THEN
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'external_id', h.external_id, 'count', h.count,
                   'held_for_s', round(extract(epoch FROM now() - h.acquired_at)::numeric, 1),
                   'expires_at', h.expires_at,
                   -- The same instant as seconds since the epoch (exact, for the clients).
                   'expires_epoch', extract(epoch FROM h.expires_at),
                   'expires_in_s', round(extract(epoch FROM h.expires_at - now())::numeric, 1))
               ORDER BY h.expires_at NULLS LAST, h.acquired_at), '[]'),
               min(h.first_held_at)
        INTO holders, first_held_at
        -- Another login's request is not named to a producer (reads follow ownership): its count
        -- and lease are what the waiter needs.
        FROM (SELECT CASE WHEN permitq.may_read(pr.submitted_by) THEN pr.external_id
                          ELSE '(another login''s request)' END AS external_id,
                     (coalesce(pr.charged, pr.permits) ->> s.name)::int AS count,
                     pr.acquired_at, pr.expires_at,
                     -- Of every holder here, not only the 10 shown (one scan: before the LIMIT).
                     min(pr.acquired_at) OVER () AS first_held_at
              FROM permitq.permit_request pr
              WHERE pr.state = 'acquired' AND coalesce(pr.charged, pr.permits) ? s.name
              ORDER BY pr.expires_at NULLS LAST, pr.acquired_at
              LIMIT 10) h;
        END IF;

        IF opens_at IS NOT NULL AND shortfall > 0 THEN
            estimated_wait := greatest(opens_at - now(), interval '0');
        ELSIF shortfall > 0 OR coalesce(permits_ahead, 0) > 0 THEN
            -- The rate between the first release of the sample and the last (what the first
            -- released came before that span), and the mean gap between releases. The estimate
            -- counts from the last release, so it falls as time passes. Releases have stopped
            -- when none came for three mean gaps (at least a second): then no estimate, the same
            -- for every waiter here, and `last_released_at` says since when. Nor once it has
            -- counted down to nothing: the rate would have made its room by now and did not,
            -- so it says nothing of when (never "about 1s" beside a holder's long lease).
            -- One release makes no rate: none, and no `last_released_at` either.
            SELECT sum((x.permits ->> s.name)::int)
                       - (array_agg((x.permits ->> s.name)::int ORDER BY x.released_at))[1],
                   min(x.released_at),
                   CASE WHEN count(*) > 1 THEN max(x.released_at) END,
                   count(*)
            INTO released_permits, released_since, last_released_at, released_count
            FROM (SELECT coalesce(pr.charged, pr.permits) AS permits, pr.released_at
                  FROM permitq.permit_request pr
                  WHERE pr.state IN ('released', 'error')
                  ORDER BY pr.settled_at DESC LIMIT 2000) x
            WHERE x.released_at IS NOT NULL AND x.permits ? s.name;
            rate := released_permits / nullif(extract(epoch FROM last_released_at - released_since), 0);
            -- Every holder here granted after the last release: those releases were of other
            -- holders, and their rate says nothing of these (a long lease just taken would read
            -- as "about 1s").
            IF first_held_at > last_released_at THEN
                rate := NULL;
            END IF;
            IF rate > 0 AND now() - last_released_at
                            <= greatest(3 * (last_released_at - released_since) / (released_count - 1),
                                        interval '1 second') THEN
                estimated_wait := make_interval(secs => least((shortfall + coalesce(beyond_ahead, permits_ahead, 0)) / rate,
                                                              315360000))
                                  - (now() - last_released_at);
                IF estimated_wait <= interval '0' THEN
                    estimated_wait := NULL;
                END IF;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;
GRANT EXECUTE ON FUNCTION permitq.explain(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Nested limits: `set_capacity('team-a', 5, parent => 'pool', guarantee => 2)`.
--
-- A grant on a semaphore with a parent also takes its count from the parent, and from the
-- parent's parent, in the same all-or-nothing decision (src/decision.rs, the one definition of
-- what a grant takes); the request records what it took (`permit_request.charged`) and a release
-- gives exactly that back. Every level is a semaphore of its own: its capacity is a ceiling on
-- everything granted below it.
--
-- Guarantees: a child's `guarantee` is a share of its parent kept for it while it is active (it
-- holds permits or has a request waiting within its unused guarantee). It is a share of the parent's room: the parent
-- competes for that room at its own parent with its own guarantee. A grant that borrows at a
-- parent, taking more there than the child's unused guarantee (or naming the parent directly),
-- must leave the parent room for every other active child's unused guarantee. A child's grant
-- within its guarantee needs only room. The guarantees of a parent's children (a template's once
-- per instance it may make) add up to at most the parent's capacity, so without borrowing every
-- child can reach its share. The guarantee of an idle child is lent: when it becomes active
-- while others hold that room, its requests wait for those releases (nobody borrows it again).

-- Each of `names` with itself (depth 0) and its ancestors, nearest first: the chain a grant
-- takes from (at most rule_max_nesting_depth() above it).
CREATE OR REPLACE FUNCTION permitq.ancestors(names text[])
RETURNS TABLE (name text, ancestor text, depth integer)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE chain(name, ancestor, depth) AS (
        SELECT n, n, 0 FROM unnest(names) n
        UNION ALL
        SELECT c.name, s.parent, c.depth + 1
        FROM chain c JOIN permitq.semaphore s ON s.name = c.ancestor
        WHERE s.parent IS NOT NULL AND c.depth < permitq.rule_max_nesting_depth()
    )
    SELECT * FROM chain
$$;

-- What a request of `permits` takes from each semaphore it names and from each of their
-- ancestors, nearest first (`depth` 0 for one it names; `via`, for an ancestor, the first
-- semaphore it names below it). Counts in bigint, shown as the most an integer holds beyond
-- it (what a request takes below one parent may pass an integer; no capacity reaches it
-- either). What `explain` and a timeout's detail count with.
CREATE OR REPLACE FUNCTION permitq.taken_by(permits jsonb)
RETURNS TABLE (name text, count integer, depth integer, via text)
LANGUAGE sql STABLE AS $$
    SELECT a.ancestor, least(sum(e.value::int8), 2147483647)::int, min(a.depth),
           min(a.name) FILTER (WHERE a.depth > 0)
    FROM jsonb_each(permits) e
    JOIN permitq.ancestors(ARRAY[e.key]) a ON a.name = e.key
    GROUP BY a.ancestor
    ORDER BY min(a.depth), a.ancestor
$$;

-- What `parent` promises its children: the sum of their guarantees, a template's once per
-- instance it may make or has made (a lowered bound leaves instances beyond it until the idle
-- sweep removes them). At most its capacity (checked by set_capacity's nesting check below);
-- also what a too_many_instances answer counts with (functions/error_details.sql).
CREATE OR REPLACE FUNCTION permitq.promised_to_children(parent text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(CASE WHEN c.is_template
                             THEN c.guarantee::bigint * greatest(
                                      coalesce(c.max_instances, permitq.rule_max_instances()),
                                      (SELECT count(*) FROM permitq.semaphore i WHERE i.template = c.name))
                             ELSE c.guarantee END), 0)::bigint
    FROM permitq.semaphore c
    WHERE c.parent = promised_to_children.parent AND c.guarantee > 0 AND c.template IS NULL
$$;

-- The semaphores a batch naming `names` locks: those and their ancestors, every one once.
-- Cheap when nothing is nested (the partial index semaphore_parent_idx is empty). The
-- guaranteed children of these are read, not locked (functions/batch_semaphores.sql).
CREATE OR REPLACE FUNCTION permitq.nesting_lock_set(names text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.parent IS NOT NULL) THEN
        RETURN names;
    END IF;
    RETURN (SELECT array_agg(DISTINCT a.ancestor) FROM permitq.ancestors(names) a);
END $$;

-- `name` as a shell takes it, for the commands messages suggest: as is, or in single quotes
-- when it has other characters than ASCII letters, digits and `-_.:/@` (`'team:*'`, `'my gpu'`;
-- a quote inside as '\''). The Rust library's `permitq::shell_word` is the same rule, for the
-- messages written there (a test compares the two).
CREATE OR REPLACE FUNCTION permitq.shell_word(name text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN name ~ '^[A-Za-z0-9_.:/@-]+$' THEN name
                ELSE '''' || replace(name, '''', '''\''''') || '''' END
$$;

-- Why `s` (as set_capacity stored it, its parent existing) cannot be so, or NULL. `moved`: its
-- parent changed. The caller holds the nesting gate and the row lock of `s`.
CREATE OR REPLACE FUNCTION permitq.nesting_problem(s permitq.semaphore, moved boolean) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    p permitq.semaphore;
    above integer := 0;
    below integer;
    -- Too deep: the most levels a new parent may have above it.
    most_above integer;
    cyclic boolean := false;
    promised bigint;
    left_over bigint;
    -- What the semaphore being set adds to its parent's sum, said when it is over.
    own text;
    -- The children that promise, named (the ten largest).
    listed text;
    biggest record;
    used_now bigint;
    waiting_now bigint;
BEGIN
    IF s.guarantee > s.capacity AND s.template IS NOT NULL THEN
        -- An instance's guarantee is its template's: say which, and both ways out.
        SELECT * INTO p FROM permitq.semaphore t WHERE t.name = s.template;
        RETURN format('guarantee %s (its template %s''s: an instance takes its parent and guarantee from its template) is more than the capacity %s: give it at least %s (`permitq semaphore set %s %s`), or lower the template''s guarantee for every instance (`permitq semaphore set %s %s --guarantee %s`)',
                      s.guarantee, s.template, s.capacity, s.guarantee,
                      permitq.shell_word(s.name), s.guarantee,
                      permitq.shell_word(s.template), coalesce(p.capacity, s.capacity), s.capacity);
    END IF;
    IF s.guarantee > s.capacity AND s.parent IS NOT NULL THEN
        -- The parent's room may bound it lower still: then only a smaller guarantee helps,
        -- and the way out says how small (the other children's guarantees leave `left_over`).
        SELECT * INTO p FROM permitq.semaphore t WHERE t.name = s.parent;
        IF p.name IS NOT NULL THEN
            promised := permitq.promised_to_children(p.name);
            left_over := p.capacity - (promised - s.guarantee);
            IF left_over < s.guarantee THEN
                -- Where the other children leave nothing, `--guarantee 0` is the one guarantee
                -- that fits, and making room in the parent the other way out.
                RETURN format('guarantee %s is more than the capacity %s, and more than %s leaves it (its other children guarantee %s of %s): %s',
                              s.guarantee, s.capacity, p.name, promised - s.guarantee, p.capacity,
                              CASE WHEN left_over > 0
                                   THEN format('give this command `--guarantee %s`%s%s',
                                               greatest(least(left_over, s.capacity), 0),
                                               CASE WHEN s.capacity > 0 THEN ' or less' ELSE '' END,
                                               CASE WHEN left_over > s.capacity
                                                    THEN format(' (or up to %s with a capacity of as much: `permitq semaphore set %s %s --parent %s --guarantee %s`)',
                                                                left_over, permitq.shell_word(s.name), left_over,
                                                                permitq.shell_word(p.name), left_over)
                                                    ELSE '' END)
                                   ELSE format('none left for %s: give this command `--guarantee 0` (%s then only borrows what is free), or make room first: raise %s (`permitq semaphore set %s %s`) or lower what its other children guarantee, then give %s a capacity of at least %s',
                                               s.name, s.name, p.name, permitq.shell_word(p.name),
                                               promised, s.name, s.guarantee) END);
            END IF;
        END IF;
    END IF;
    IF s.guarantee > s.capacity THEN
        -- The way out in full: the command keeps the parent and guarantee asked for (run
        -- alone, `semaphore set NAME G` would make a new one without them).
        RETURN format('guarantee %s is more than the capacity %s: give it at least %s (`permitq semaphore set %s %s%s --guarantee %s`), or a smaller guarantee (`--guarantee %s`)',
                      s.guarantee, s.capacity, s.guarantee, permitq.shell_word(s.name),
                      s.guarantee,
                      CASE WHEN s.parent IS NOT NULL
                           THEN ' --parent ' || permitq.shell_word(s.parent) ELSE '' END,
                      s.guarantee, s.capacity);
    END IF;
    IF s.guarantee > 0 AND s.parent IS NULL THEN
        RETURN format('a guarantee is a share of a parent: give it one (`permitq semaphore set %s %s --parent PARENT --guarantee %s`), or leave --guarantee out',
                      permitq.shell_word(s.name), s.capacity, s.guarantee);
    END IF;
    IF s.parent IS NOT NULL THEN
        SELECT * INTO p FROM permitq.semaphore t WHERE t.name = s.parent;
        IF p.is_template OR p.template IS NOT NULL THEN
            RETURN format('parent %s is a template or made from one; a parent must be a plain semaphore', s.parent);
        END IF;
    END IF;
    -- The chain above: no cycle, not too deep (with the deepest chain below `s`). Walked from
    -- the parent, so that a chain one level too deep is still seen.
    IF s.parent IS NOT NULL THEN
        SELECT max(a.depth) + 1, bool_or(a.ancestor = s.name) INTO above, cyclic
        FROM permitq.ancestors(ARRAY[s.parent]) a;
    END IF;
    IF cyclic THEN
        RETURN format('parent %s is %s itself or below it', s.parent, s.name);
    END IF;
    WITH RECURSIVE down(name, depth) AS (
        SELECT s.name, 0
        UNION ALL
        SELECT c.name, d.depth + 1 FROM down d JOIN permitq.semaphore c ON c.parent = d.name
        WHERE d.depth <= permitq.rule_max_nesting_depth()
    )
    SELECT max(depth) INTO below FROM down;
    IF above + below > permitq.rule_max_nesting_depth() THEN
        -- Counted from the deepest semaphore of the tree moved: what it would have above it.
        -- The way out: a parent with few enough above it (`most_above`), or none.
        most_above := permitq.rule_max_nesting_depth() - below - 1;
        RETURN format('nesting too deep: %s would have %s %s above it%s, and a semaphore may have at most %s (its parents, their parents, and so on): %s',
                      s.name, above, CASE WHEN above = 1 THEN 'level' ELSE 'levels' END,
                      CASE WHEN below > 0
                           THEN format(' and %s below, so the semaphores deepest below it would have %s above them', below, above + below)
                           ELSE '' END,
                      permitq.rule_max_nesting_depth(),
                      CASE WHEN most_above >= 0
                           THEN format('choose a parent with at most %s above it, or none (`--no-parent`)', most_above)
                           ELSE 'leave it without a parent (`--no-parent`), or move what is below it up first' END);
    END IF;
    -- A semaphore holding permits keeps its parent: they were taken from the one it has (for
    -- a template, what its instances hold).
    IF moved THEN
        SELECT coalesce(sum(t.used), 0),
               coalesce(sum((SELECT count(*) FROM permitq.waiter w WHERE w.semaphore_id = t.id)), 0)
        INTO used_now, waiting_now
        FROM permitq.semaphore t
        WHERE t.name = s.name OR (s.is_template AND t.template = s.name);
        IF used_now > 0 OR waiting_now > 0 THEN
            RETURN format('%s holds permits or has waiters (used %s, %s waiting%s): its parent can change once it is idle; %s',
                          s.name, used_now, waiting_now,
                          CASE WHEN s.is_template THEN ', over its instances' ELSE '' END,
                          CASE WHEN s.is_template
                               THEN format('`permitq semaphore show ''%s''` names its instances, and `permitq semaphore show INSTANCE` their holders and waiters', s.name)
                               ELSE format('`permitq semaphore show %s` lists the holders and waiters', permitq.shell_word(s.name)) END);
        END IF;
    END IF;
    -- What the parent promises its children, and what `s` promises its own.
    FOR p IN SELECT * FROM permitq.semaphore t WHERE t.name IN (s.parent, s.name) LOOP
        promised := permitq.promised_to_children(p.name);
        IF promised > p.capacity THEN
            -- The semaphore being set is one of those children: its own guarantee (kept from
            -- before when this change does not give one) is in the sum, and this command can
            -- lower it.
            own := CASE WHEN p.name = s.parent AND s.guarantee > 0
                        THEN format(' (%s''s guarantee of %s counts in that sum: a lower `--guarantee N` on this command lowers it, `--guarantee 0` for none)',
                                    s.name, s.guarantee)
                        ELSE '' END;
            -- A template's bound is the likely cause (10000 instances unless set): name it,
            -- with the instances it has (they count while they exist, above a bound too).
            SELECT c.name, c.guarantee, coalesce(c.max_instances, permitq.rule_max_instances()) AS max_instances,
                   (SELECT count(*) FROM permitq.semaphore i WHERE i.template = c.name) AS made
            INTO biggest
            FROM permitq.semaphore c
            WHERE c.parent = p.name AND c.guarantee > 0 AND c.is_template
            ORDER BY c.guarantee::bigint * coalesce(c.max_instances, permitq.rule_max_instances()) DESC
            LIMIT 1;
            IF biggest.name IS NOT NULL THEN
                -- What the others leave it: the bound to set, or (none left) the parent to raise
                -- first, and the bound with it. Raising the parent to the whole sum is offered
                -- only for a bound someone set: for the default one it would mean a capacity in
                -- the tens of thousands.
                left_over := p.capacity - (promised - biggest.guarantee::bigint
                                                      * greatest(biggest.max_instances, biggest.made));
                -- Unbounded (the default max_instances): the one-line answer first.
                RETURN format('%sthe guarantees of the children of %s add up to %s, more than its capacity %s%s: template %s guarantees %s to each of up to %s instances (its max_instances%s)%s; %s; or give it none (`permitq semaphore set ''%s'' CAPACITY --guarantee 0`: its instances then borrow what is free, unbounded)',
                              -- The first words name the cause: no room left in the parent
                              -- (a bound would not help), else an unbounded template.
                              CASE WHEN left_over < biggest.guarantee
                                   THEN format('no room left in %s for template %s''s guarantee (its other children guarantee %s of %s): ',
                                               p.name, biggest.name,
                                               p.capacity - left_over, p.capacity)
                                   WHEN biggest.max_instances = permitq.rule_max_instances()
                                   THEN format('template %s needs --max-instances to keep a guarantee (each instance it may make is guaranteed its share): ', biggest.name)
                                   ELSE '' END,
                              p.name, promised, p.capacity, own, biggest.name, biggest.guarantee,
                              biggest.max_instances,
                              CASE WHEN biggest.max_instances = permitq.rule_max_instances() THEN ', by default' ELSE '' END,
                              CASE WHEN biggest.made > 0
                                   THEN format(', and has %s now', biggest.made) ELSE '' END,
                              CASE WHEN left_over >= biggest.guarantee
                                   THEN format('bound them: `permitq semaphore set ''%s'' CAPACITY --guarantee %s --max-instances N` with N at most %s (its other children''s guarantees leave %s of %s)%s%s',
                                               biggest.name, biggest.guarantee, left_over / biggest.guarantee,
                                               left_over, p.name,
                                               CASE WHEN biggest.made > left_over / biggest.guarantee
                                                    THEN format('; instances beyond the bound count until they are gone: delete %s of them (`permitq semaphore show ''%s''` lists them, `permitq semaphore delete NAME` removes one that holds nothing)',
                                                                biggest.made - left_over / biggest.guarantee, biggest.name)
                                                    ELSE '' END,
                                               CASE WHEN biggest.max_instances = permitq.rule_max_instances() THEN ''
                                                    ELSE format(', or raise %s (`permitq semaphore set %s %s`)', p.name, permitq.shell_word(p.name), promised) END)
                                   ELSE format('its other children''s guarantees leave %s of %s, less than one instance''s %s: raise %s and bound the template (%s for N instances): for %s, `permitq semaphore set %s %s`, then `permitq semaphore set %s CAPACITY --guarantee %s --max-instances %s`; or lower a guarantee',
                                               greatest(left_over, 0), p.name, biggest.guarantee, p.name,
                                               format('%s + N × %s', p.capacity - greatest(left_over, 0), biggest.guarantee),
                                               CASE WHEN biggest.made > 1 THEN format('its %s', biggest.made) ELSE 'one' END,
                                               permitq.shell_word(p.name), p.capacity - greatest(left_over, 0)
                                                       + biggest.guarantee::bigint * greatest(biggest.made, 1),
                                               permitq.shell_word(biggest.name), biggest.guarantee, greatest(biggest.made, 1)) END,
                              biggest.name);
            END IF;
            -- Which children promise what (the ten largest), and the way out for this command:
            -- for the child being set, the most the others leave it; for the parent, the least
            -- it needs.
            SELECT string_agg(format('%s %s', c.name, c.guarantee), ', ' ORDER BY c.guarantee DESC, c.name)
            INTO listed
            FROM (SELECT t.name, t.guarantee FROM permitq.semaphore t
                  WHERE t.parent = p.name AND t.guarantee > 0 AND t.template IS NULL
                  ORDER BY t.guarantee DESC, t.name LIMIT 10) c;
            IF p.name = s.parent AND s.guarantee > 0 THEN
                left_over := p.capacity - (promised - s.guarantee);
                RETURN format('the guarantees of the children of %s add up to %s (%s), more than its capacity %s: %s',
                              p.name, promised, listed, p.capacity,
                              CASE WHEN left_over > 0
                                   THEN format('the others guarantee %s of %s, so %s may have at most %s: give this command `--guarantee %s` or less (`--guarantee 0` for none: %s then only borrows what is free), or raise %s first (`permitq semaphore set %s %s`)',
                                               promised - s.guarantee, p.capacity, s.name, left_over,
                                               left_over, s.name, p.name, permitq.shell_word(p.name), promised)
                                   ELSE format('the others guarantee %s of %s, none left for %s: give this command `--guarantee 0` (%s then only borrows what is free), or raise %s first (`permitq semaphore set %s %s`)',
                                               promised - s.guarantee, p.capacity, s.name, s.name,
                                               p.name, permitq.shell_word(p.name), promised) END);
            END IF;
            RETURN format('the guarantees of the children of %s add up to %s (%s), more than its capacity %s: give it at least %s (`permitq semaphore set %s %s`), or lower a child''s guarantee first (`permitq semaphore set CHILD CAPACITY --guarantee N`; `--guarantee 0` for none: that child then only borrows what is free)',
                          p.name, promised, listed, p.capacity, promised,
                          permitq.shell_word(p.name), promised);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

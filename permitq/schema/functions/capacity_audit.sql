-- The capacity audit: creation, every UPDATE that sets capacity, fair, parent, guarantee,
-- max_instances or per (set_capacity, a template's change reaching its instances, or a hand-written UPDATE), even
-- when the value stays the same. A deletion by permitq.delete_semaphore (functions/set_capacity.sql)
-- writes its own row (`deleted`); the workers' removal of an idle instance, which a request makes
-- again, is not audited. Changes to `used` are not audited.

-- One row of the audit: the semaphore's bounds before (`old`, NULL at creation) and after
-- (`new`; for a deletion, the bounds it had), by the login that asked (session_user: the callers
-- run as the schema's owner).
CREATE OR REPLACE FUNCTION permitq.record_capacity_change(old permitq.semaphore,
                                                          new permitq.semaphore, deleted boolean)
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO permitq.capacity_change (semaphore, old_capacity, new_capacity, old_fair, new_fair,
                                         old_parent, new_parent, old_guarantee, new_guarantee,
                                         old_max_instances, new_max_instances, old_per, new_per,
                                         changed_by, deleted)
    VALUES (new.name, old.capacity, new.capacity, old.fair, new.fair, old.parent, new.parent,
            old.guarantee, new.guarantee, old.max_instances, new.max_instances, old.per, new.per,
            session_user, deleted)
$$;

CREATE OR REPLACE FUNCTION permitq.audit_capacity() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    PERFORM permitq.record_capacity_change(CASE WHEN TG_OP = 'UPDATE' THEN OLD END, NEW, false);
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER semaphore_created AFTER INSERT ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();
CREATE OR REPLACE TRIGGER semaphore_capacity_changed AFTER UPDATE OF capacity, fair, parent, guarantee, max_instances, per ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();

-- The audit of a setting kept outside the semaphore's row (adaptive, fairness keys): `setting`
-- ({"adaptive": ...}, {"fairness_keys": true}) merged into `inputs` of the row this transaction
-- just wrote for the semaphore, when there is one (its creation by set_capacity, or the capacity
-- brought within adaptive bounds): one change, one row. Otherwise a row of its own, with the
-- semaphore as it is now. (Written in a subtransaction, a row's xmin is not this one's: it gets a
-- row of its own.)
CREATE OR REPLACE FUNCTION permitq.audit_setting(s permitq.semaphore, setting jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.capacity_change x
                   WHERE x.id = (SELECT max(y.id) FROM permitq.capacity_change y
                                 WHERE y.semaphore = s.name)
                     -- This transaction's: its 32-bit xid, and written since it began (an
                     -- old row whose xmin comes round again 2^32 transactions later is not).
                     AND x.xmin = pg_current_xact_id()::xid AND x.changed_at >= now()
                     AND NOT x.deleted) THEN
        PERFORM permitq.record_capacity_change(s, s, false);
    END IF;
    UPDATE permitq.capacity_change c SET inputs = coalesce(c.inputs, '{}') || setting
    WHERE c.id = (SELECT max(x.id) FROM permitq.capacity_change x WHERE x.semaphore = s.name);
END $$;

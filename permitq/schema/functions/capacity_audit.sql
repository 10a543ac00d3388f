-- The capacity audit: creation, every UPDATE that sets capacity, fair, parent, guarantee,
-- max_instances or per (set_capacity, a template's change reaching its instances, or a hand-written UPDATE), even
-- when the value stays the same. A deletion by permitq.delete_semaphore (functions/set_capacity.sql)
-- writes its own row (`deleted`); the workers' removal of an idle instance, which a request makes
-- again, is not audited. Changes to `used` are not audited.

CREATE OR REPLACE FUNCTION permitq.audit_capacity() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    -- By the login that asked (session_user): this runs as the schema's owner (current_user).
    INSERT INTO permitq.capacity_change (semaphore, old_capacity, new_capacity, old_fair, new_fair,
                                         old_parent, new_parent, old_guarantee, new_guarantee,
                                         old_max_instances, new_max_instances, old_per, new_per,
                                         changed_by)
    VALUES (NEW.name,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.capacity END, NEW.capacity,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.fair END, NEW.fair,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.parent END, NEW.parent,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.guarantee END, NEW.guarantee,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.max_instances END, NEW.max_instances,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.per END, NEW.per, session_user);
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER semaphore_created AFTER INSERT ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();
CREATE OR REPLACE TRIGGER semaphore_capacity_changed AFTER UPDATE OF capacity, fair, parent, guarantee, max_instances, per ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();

-- Ownership: a request belongs to the login role that submitted it (`submitted_by`, the
-- session's role). Only that role, or an admin (permitq.is_admin), may release, cancel or
-- heartbeat it, and producers read only their own requests (row-level security, migration V3).
-- Applications that share one login role share ownership of their requests.

-- These functions are parsed under the caller's search_path (the views call them as their
-- reader, and they are not SECURITY DEFINER): every operator in them is pg_catalog's, named so,
-- or a producer could put its own `=` ahead of it.

-- Whether the session is an admin: a member of permitq_admin, or a login with the privileges
-- of the role that owns the permitq schema (the login that migrated it, which owns every table
-- and function already; USAGE: a member that inherits them, not any member of a group owner).
CREATE OR REPLACE FUNCTION permitq.is_admin() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pg_catalog.pg_has_role(session_user, 'permitq_admin', 'MEMBER')
        OR coalesce(pg_catalog.pg_has_role(
               session_user,
               (SELECT n.nspowner FROM pg_catalog.pg_namespace n
                WHERE n.nspname OPERATOR(pg_catalog.=) 'permitq'::pg_catalog.name),
               'USAGE'), false)
$$;
GRANT EXECUTE ON FUNCTION permitq.is_admin()
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Whether the session may act on a request submitted by `submitted_by`.
CREATE OR REPLACE FUNCTION permitq.may_act_on(submitted_by text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT submitted_by OPERATOR(pg_catalog.=) session_user::pg_catalog.text
        OR permitq.is_admin()
$$;

-- Whether the session reads every request (admins, the schema's owner among them, workers and
-- operators), not only its own.
-- The views call it as their reader.
CREATE OR REPLACE FUNCTION permitq.reads_every_request() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT permitq.is_admin()
        OR pg_catalog.pg_has_role(session_user, 'permitq_worker', 'MEMBER')
        OR pg_catalog.pg_has_role(session_user, 'permitq_operator', 'MEMBER')
$$;
GRANT EXECUTE ON FUNCTION permitq.reads_every_request()
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Whether the session may read a request submitted by `submitted_by`: its own, or every one
-- (the rule of `status`, `explain`, `await_settled` and the views; the table's row-level
-- security policy, migration V8, says the same). The views call it as their reader.
CREATE OR REPLACE FUNCTION permitq.may_read(submitted_by text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT submitted_by OPERATOR(pg_catalog.=) session_user::pg_catalog.text
        OR permitq.reads_every_request()
$$;
GRANT EXECUTE ON FUNCTION permitq.may_read(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Raises 42501 unless the session may act on `request`.
CREATE OR REPLACE FUNCTION permitq.check_owner(request permitq.permit_request, action text)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF permitq.may_act_on(request.submitted_by) IS NOT TRUE THEN
        RAISE EXCEPTION 'permission denied: request % belongs to another role; only it or permitq_admin may %',
            request.external_id, action USING ERRCODE = '42501';
    END IF;
END $$;

-- Input checks shared by submit, the insert trigger and the worker: why a value is invalid, or
-- NULL when it is fine. Each message names what is wrong; the caller names the field.

-- A permits object: {"semaphore": count, ...}, 1 to rule_max_semaphores() entries, names of 1 to
-- rule_max_name_length() characters, counts from 1 to 2147483647.
CREATE OR REPLACE FUNCTION permitq.permits_problem(p jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    entry record;
    n int := 0;
    count_value numeric;
BEGIN
    IF p IS NULL THEN
        RETURN 'must not be null';
    END IF;
    IF jsonb_typeof(p) <> 'object' THEN
        RETURN format('must be a JSON object {"semaphore": count, ...}, got %s', jsonb_typeof(p));
    END IF;
    FOR entry IN SELECT key, value FROM jsonb_each(p) LOOP
        n := n + 1;
        IF entry.key = '' THEN
            RETURN 'semaphore name must not be empty';
        END IF;
        IF length(entry.key) > permitq.rule_max_name_length() THEN
            RETURN format('semaphore name must be at most %s characters', permitq.rule_max_name_length());
        END IF;
        IF jsonb_typeof(entry.value) <> 'number' THEN
            RETURN format('count for %s must be an integer, got %s', entry.key, entry.value);
        END IF;
        count_value := entry.value::numeric;
        IF count_value <> trunc(count_value) THEN
            RETURN format('count for %s must be an integer, got %s', entry.key, entry.value);
        END IF;
        IF count_value < 1 OR count_value > 2147483647 THEN
            RETURN format('count for %s must be between 1 and 2147483647, got %s', entry.key, entry.value);
        END IF;
    END LOOP;
    IF n = 0 THEN
        RETURN 'must name at least one semaphore';
    END IF;
    IF n > permitq.rule_max_semaphores() THEN
        RETURN format('must name at most %s semaphores, got %s', permitq.rule_max_semaphores(), n);
    END IF;
    RETURN NULL;
END $$;

-- A ttl, wait, extend or per: positive (or zero, where zero_allowed) and at most
-- rule_max_duration(), its months, days and time all of one sign (added to a timestamp, '1 mon
-- -30 days' is negative in February), months counted as a twelfth of a year of 365.25 days (so
-- '121 months' is past '10 years', which PostgreSQL's 30-day months would not say). NULL
-- itself is fine: a default.
-- (PL/pgSQL keeps its plans per session; a SQL function that cannot be inlined, as this one,
-- calling format(), is parsed again by every statement that calls it.)
CREATE OR REPLACE FUNCTION permitq.interval_problem(value interval, zero_allowed boolean) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    months numeric;
    days numeric;
    seconds numeric;
    total numeric;
BEGIN
    IF value IS NULL THEN
        RETURN NULL;
    END IF;
    months := extract(year FROM value) * 12 + extract(month FROM value);
    days := extract(day FROM value);
    seconds := extract(epoch FROM value - make_interval(months => months::int, days => days::int));
    IF least(months, days, seconds) < 0 AND greatest(months, days, seconds) > 0 THEN
        RETURN format('must not mix signs (months, days, time), got %s', value);
    END IF;
    total := months * 2629800 + days * 86400 + seconds;
    RETURN CASE
        WHEN zero_allowed AND total < 0 THEN format('must not be negative, got %s', value)
        WHEN NOT zero_allowed AND total <= 0 THEN format('must be positive, got %s', value)
        WHEN total > extract(epoch FROM permitq.rule_max_duration())
            THEN format('must be at most %s, got %s', permitq.rule_max_duration_text(), value)
    END;
END $$;

-- A stored request the worker cannot decide: what it checks on every request it has not
-- examined yet, rows written past the constraints (triggers off) included.
CREATE OR REPLACE FUNCTION permitq.request_problem(r permitq.permit_request) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce('permits: ' || permitq.permits_problem(r.permits),
                    'ttl: ' || permitq.interval_problem(r.ttl, false),
                    'wait: ' || permitq.interval_problem(r.wait, true))
$$;

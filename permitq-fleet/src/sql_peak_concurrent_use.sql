-- Interval sweep over every permit: per semaphore, the largest sum of counts held at one
-- instant, next to the highest capacity the semaphore ever had. A permit is held over
-- [acquired_at, released_at); at equal instants the -count events sort first.
WITH events AS (
    SELECT semaphore, acquired_at AS at, count AS delta FROM permitq.permit
    UNION ALL
    SELECT semaphore, released_at, -count FROM permitq.permit WHERE released_at IS NOT NULL
),
running AS (
    SELECT semaphore,
           sum(delta) OVER (PARTITION BY semaphore ORDER BY at, delta
                            ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS held
    FROM events
)
SELECT s.name,
       coalesce(max(r.held), 0)::int8 AS peak,
       greatest(s.capacity,
                (SELECT max(c.new_capacity) FROM permitq.capacity_change c
                 WHERE c.semaphore = s.name))::int8 AS capacity
FROM permitq.semaphore s
LEFT JOIN running r ON r.semaphore = s.name
GROUP BY s.name, s.capacity
ORDER BY s.name

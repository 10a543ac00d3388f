-- Each semaphore's line of recorded waiters in line order (rule_place_in_line, best first; among
-- equals the lower request id): the claim reads the first of a line with room, and the heads the
-- first of a line outside a batch, each in work per request read, however many priority levels
-- the line has (functions/claim.sql, functions/heads.sql). Reading them a level at a time made a
-- line spread over all 201 levels cost a claim of every waiter on a semaphore with room.
CREATE INDEX waiter_place_idx
    ON permitq.waiter (semaphore_id, permitq.rule_place_in_line(priority, created_at) DESC,
                       request_id);

-- And by count, biggest first: a waiter whose count its semaphore's capacity no longer covers
-- (lowered while it waited) is found in one index range read, not a look per priority level.
CREATE INDEX waiter_count_idx ON permitq.waiter (semaphore_id, count DESC);

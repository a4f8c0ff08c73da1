-- A run held up by a dependency that has been gone past the grace period shows `waiting`
-- (with the reason); it is still owned and driven like a running one.
ALTER TABLE runs DROP CONSTRAINT runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled'));

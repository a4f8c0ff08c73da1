-- The generators a run holds (by id), so that a run resumed by another orchestrator claims
-- the same ones again before their leases run out.
ALTER TABLE runs ADD COLUMN generators text[] NOT NULL DEFAULT '{}';
